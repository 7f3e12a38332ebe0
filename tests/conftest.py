"""Tiny random-weight models of every supported family, built from configs in milliseconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from rankkit.models import SUPPORTED_FAMILIES

# Every supported family but Gemma 3's multimodal checkpoints (their text decoder is gemma3_text, and
# test_runner runs one whole), and Llama with as many KV heads as query heads.
FAMILIES = ("llama", "llama-mha", *(family for family in SUPPORTED_FAMILIES[1:] if family != "gemma3"))
# Families whose layers are not all global: half the layers see only the last 8 keys.
HYBRID = ["sliding_attention", "full_attention", "sliding_attention"]
# What makes each family's attention differ from Llama's, at a size that builds in milliseconds.
FAMILY_CONFIGS = {
    "llama": {},
    "llama-mha": {"num_key_value_heads": 4},
    "mistral": {"sliding_window": 8},  # a short window so the sliding mask really cuts in
    "qwen2": {},
    "qwen3": {"head_dim": 24},  # QK-norm, and head_dim not tied to hidden_size / heads
    "gemma2": {  # soft-capped logits, query_pre_attn_scalar scaling, alternating local layers
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
        "sliding_window": 8,
        "layer_types": HYBRID,
    },
    "gemma3_text": {  # local and global layers rotate with different RoPE bases
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 8,
        "layer_types": HYBRID,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "phi3": {"sliding_window": None},  # fused qkv projection
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 24},
    "gpt_oss": {  # learned attention sinks, alternating local layers, YaRN RoPE
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": HYBRID,
    },
    "smollm3": {"no_rope_layers": [1, 1, 0], "no_rope_layer_interval": 3},  # the last layer has no RoPE
    "olmo2": {},  # QK-norm over the whole projection, norms after attention and MLP
    "olmo3": {"sliding_window": 8, "layer_types": HYBRID},  # and alternating local layers
    "granite": {  # multipliers on the embeddings, the attention logits, each residual branch; logits divided
        "embedding_multiplier": 3.0,
        "attention_multiplier": 0.05,
        "residual_multiplier": 0.5,
        "logits_scaling": 4.0,
    },
    "cohere": {"logit_scale": 0.3, "use_qk_norm": True},  # parallel attention and MLP, interleaved RoPE, QK-norm
    "cohere2": {"logit_scale": 0.3, "sliding_window": 8, "layer_types": HYBRID},  # global layers without RoPE
    "glm": {"partial_rotary_factor": 0.5},  # RoPE on half of each head, interleaved
    "glm4": {"partial_rotary_factor": 0.5},  # and norms after attention and MLP
    "exaone4": {"sliding_window": 8, "layer_types": HYBRID},  # QK-norm; global layers without RoPE
    "seed_oss": {"attention_bias": True},  # biased query, key and value projections
}


def tiny_config(family: str):
    from transformers import AutoConfig

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model_type = "llama" if family == "llama-mha" else family
    return AutoConfig.for_model(model_type, **{**common, **FAMILY_CONFIGS[family]})


def one_kv_head_runner():
    """A tiny random Llama with a single KV head (multi-query attention), as a Runner."""
    from transformers import AutoModelForCausalLM

    from rankkit.runner import Runner

    config = tiny_config("llama")
    config.num_key_value_heads = 1
    torch.manual_seed(0)
    return Runner(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


def attended_keys_recorder():
    """A hook recording, at every decode step, the positions each layer's attention sees per KV head
    (padding left out): ``.steps[step][layer]``."""
    from rankkit.cache import PADDING
    from rankkit.runner import LayerHook

    class AttendedKeys(LayerHook):
        def __init__(self):
            self.steps: list[dict[int, list[list[int]]]] = []

        def on_attention(self, call):
            if call.phase != "decode":
                return
            if call.layer == 0:
                self.steps.append({})
            heads = call.key_positions.tolist()
            self.steps[-1][call.layer] = [sorted(p for p in head if p != PADDING) for head in heads]

    return AttendedKeys()


def tiny_model(family: str, seed: int = 0, layers: int | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family)
    if layers is not None:
        config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights make attention peaked, so ranking differences show
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                parameter.mul_(8.0)
            if name.endswith("sinks"):  # sinks large enough to take a visible share of attention
                parameter.normal_(0.0, 2.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def pytest_configure(config):
    """The Ctrl-C tests need SIGINT deliverable. A shell without job control starts a background
    command (``make test &``) with SIGINT ignored, and an ignored signal survives exec into every
    command a test starts; a handler, unlike an ignore, is reset by exec, so children get the default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def random_ids():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (40,), generator=generator)


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model (SmolLM2-135M-Instruct), converted once into the rankkit cache."""
    from rankkit import models

    return models.load("default", device="cpu")


@pytest.fixture(autouse=True)
def _threads():
    """Every test on the same threads, set again after it: a test whose --threads 1 stayed set made
    the next module's fixtures compute on one thread, and a store compared exactly with one made on
    two differed in its last bits."""
    threads = max(1, min(2, os.cpu_count() or 1))
    torch.set_num_threads(threads)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_model_load(monkeypatch, tmp_path):
    """Any weight loading fails the test: the refusals must come before it. Runs in ``tmp_path``."""
    import rankkit.models

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(rankkit.models, "load", forbidden)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def default_tokenizer():
    from rankkit import models

    return models.load_tokenizer("default")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, default_tokenizer):
    """A tiny random Llama saved as an HF folder with the default tokenizer: loads like any user model."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.vocab_size = len(default_tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return folder


def own_position_writes(layers: int, cuda_graphs: bool) -> int:
    """Launches a decode step beyond full's where every layer holds positions of its own (compressed,
    pruned): full's layers share one write (``KVCache._append_positions``), the others write each;
    the static cache writes every layer's, full's too."""
    return 0 if cuda_graphs else layers - 1


def run_on_two_gloo_ranks(port: int, *arguments) -> subprocess.CompletedProcess:
    """``rankkit ARGUMENTS`` under torchrun with two CPU (gloo) ranks of one thread each."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(port), "-m", "rankkit.cli", *map(str, arguments)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
