"""Tiny random-weight models of every supported family, built from configs in milliseconds."""

from __future__ import annotations

import os

import pytest
import torch

FAMILIES = ("llama", "llama-mha", "mistral", "qwen2", "qwen3")


def tiny_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama-mha":
        return LlamaConfig(**{**common, "num_key_value_heads": 4})
    if family == "mistral":  # a short window so the sliding mask really cuts in
        return MistralConfig(**common, sliding_window=8)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":  # QK-norm, and head_dim not tied to hidden_size / heads
        return Qwen3Config(**common, head_dim=24)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():  # larger weights make attention peaked, so ranking differences show
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


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


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
