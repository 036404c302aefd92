import json

import numpy as np
import pytest  # noqa: F401

QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 20,
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


class Versioned:
    """A numpy array with an in-place version counter, as torch keeps one per tensor."""

    def __init__(self, a):
        self.a = a
        self._version = 0

    def write(self, values):
        self.a[...] = values
        self._version += 1


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (torch's `.to(torch.bfloat16)`)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


