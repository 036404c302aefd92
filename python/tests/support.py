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


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (torch's `.to(torch.bfloat16)`)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)




def e4m3_values(b):
    """float8_e4m3fn bytes -> float32 values (NaN for 0x7f / 0xff), as torch decodes them."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1.0 + m / 8.0) * 2.0 ** (e - 7))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return (sign * mag).astype(np.float32)


def block_scales(x):
    """The block formula's `scale_inv` of a 2-D f32 matrix: max |x| over each 128 x 128 block
    (partial at the edges) / 448 in f32, 1 for an all-zero block."""
    x = np.asarray(x, dtype=np.float32)
    rb, cb = -(-x.shape[0] // 128), -(-x.shape[1] // 128)
    out = np.empty((rb, cb), np.float32)
    for i in range(rb):
        for j in range(cb):
            amax = np.abs(x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]).max()
            out[i, j] = np.float32(amax) / np.float32(448.0) if amax > 0 else np.float32(1.0)
    return out
