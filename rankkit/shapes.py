"""The published architectures ``--model random:<shape>`` builds with random weights (``rankkit.models``).

Apart from the model code, so the CLI's help can name them without importing torch.
"""

# The config.json of each published checkpoint, as far as it shapes the compute: what
# ``--model random:<shape>`` builds, so a GPU budget can be planned without the weights.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ROPE |= {"original_max_position_embeddings": 8192}
PUBLISHED_SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(  # Qwen/Qwen2.5-7B-Instruct
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        use_sliding_window=False,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M-Instruct: the default model's shape
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "mistral-7b": dict(  # mistralai/Mistral-7B-Instruct-v0.3
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32768,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
}
