"""GPU tests of the bridge: PyTorch FSDP2 at W = 1 on one GPU (run on a machine with torch and
transformers: `pytest python/tests/gpu`). Skipped where torch or a GPU is missing."""

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
transformers = pytest.importorskip("transformers")


def qwen2_config(**over):
    cfg = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    cfg.update(over)
    return transformers.Qwen2Config(**cfg)


def fsdp2_model(config, seed=0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(config).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model
