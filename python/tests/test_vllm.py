"""vLLM's runtime names, shapes and fused contents, from the host backend's rollout."""

import json

import numpy as np
import pytest

import lifecycle
from lifecycle import ConfigError, Switch
from support import bf16_bits

QWEN2_KV1 = {
    "model_type": "qwen2", "vocab_size": 128, "hidden_size": 16, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 32,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}
QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 120, "hidden_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 32,
    "rope_theta": 10000.0, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 8, "mlp_only_layers": [0], "tie_word_embeddings": True,
}
# a vocabulary of 120 pads to 128 (vLLM's multiple of 64) at T = 1; at T = 2 vLLM's split of
# the padded 128 rows is 64 per rank, which the rollout's own split matches only at 128
QWEN3_MOE_128 = {**QWEN3_MOE, "vocab_size": 128}


def arrays(config, seed=3):
    rng = np.random.default_rng(seed)
    return [
        (n, rng.standard_normal(s).astype(np.float32))
        for n, s in lifecycle.expected_parameters(json.dumps(config))
    ]


def expected(config, full, tp, rank, experts):
    """vLLM's tensors of `rank`, built from the full fp32 tensors by vLLM's rules."""
    h = config["hidden_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim", h // heads)
    if config["model_type"] == "qwen2":
        hd = h // heads
    vocab = config["vocab_size"]
    padded = -(-vocab // 64) * 64
    per = padded // tp
    out = {}

    def vocab_rows(t):
        rows = t[rank * per : min((rank + 1) * per, vocab)]
        return np.concatenate([rows, np.zeros((per - rows.shape[0], h), np.float32)])

    out["model.embed_tokens.weight"] = vocab_rows(full["model.embed_tokens.weight"])
    q_local = heads // tp
    if kv >= tp:
        kv_heads = range(rank * kv // tp, (rank + 1) * kv // tp)
    else:
        g = rank // (tp // kv)
        kv_heads = range(g, g + 1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q = full.get(f"{p}self_attn.q_proj.{kind}")
            if q is None:
                continue
            k, v = full[f"{p}self_attn.k_proj.{kind}"], full[f"{p}self_attn.v_proj.{kind}"]
            qs = q[rank * q_local * hd : (rank + 1) * q_local * hd]
            ks = k[kv_heads.start * hd : kv_heads.stop * hd]
            vs = v[kv_heads.start * hd : kv_heads.stop * hd]
            out[f"{p}self_attn.qkv_proj.{kind}"] = np.concatenate([qs, ks, vs])
        o = full[f"{p}self_attn.o_proj.weight"]
        out[f"{p}self_attn.o_proj.weight"] = o[:, rank * q_local * hd : (rank + 1) * q_local * hd]
        for n in ("self_attn.q_norm.weight", "self_attn.k_norm.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight"):
            if p + n in full:
                out[p + n] = full[p + n]
        if f"{p}mlp.gate_proj.weight" in full:
            f = config["intermediate_size"] // tp
            g, u = full[f"{p}mlp.gate_proj.weight"], full[f"{p}mlp.up_proj.weight"]
            out[f"{p}mlp.gate_up_proj.weight"] = np.concatenate(
                [g[rank * f : (rank + 1) * f], u[rank * f : (rank + 1) * f]]
            )
            d = full[f"{p}mlp.down_proj.weight"]
            out[f"{p}mlp.down_proj.weight"] = d[:, rank * f : (rank + 1) * f]
        elif f"{p}mlp.experts.0.gate_proj.weight" in full:
            e_all, f_all = config["num_experts"], config["moe_intermediate_size"]
            if experts == "ep":
                ids, cols = range(rank * e_all // tp, (rank + 1) * e_all // tp), slice(None)
            else:
                ids, cols = range(e_all), slice(rank * f_all // tp, (rank + 1) * f_all // tp)
            ex = lambda e, w: full[f"{p}mlp.experts.{e}.{w}_proj.weight"]  # noqa: E731
            out[f"{p}mlp.experts.w13_weight"] = np.stack(
                [np.concatenate([ex(e, "gate")[cols], ex(e, "up")[cols]]) for e in ids]
            )
            out[f"{p}mlp.experts.w2_weight"] = np.stack([ex(e, "down")[:, cols] for e in ids])
    out["model.norm.weight"] = full["model.norm.weight"]
    if "lm_head.weight" in full:
        out["lm_head.weight"] = vocab_rows(full["lm_head.weight"])
    return out


@pytest.mark.parametrize(
    "config,tp,experts",
    [(QWEN2_KV1, 1, "tp"), (QWEN2_KV1, 2, "tp"), (QWEN3_MOE, 1, "tp"), (QWEN3_MOE_128, 2, "tp"),
     (QWEN3_MOE_128, 2, "ep")],
)
def test_vllm_format_is_vllms_layout_of_the_weights(config, tp, experts):
    params = arrays(config)
    full = dict(params)
    switch = Switch.from_arrays(config, params, world=2, rollout_tp=tp, experts=experts)
    for rank in range(tp):
        with switch.rollout() as w:
            got = dict(w.named_arrays("vllm", rank))
        want = expected(config, full, tp, rank, experts)
        names = [n for n, _ in lifecycle.vllm_names(config, tp, experts=experts)]
        assert list(got) == names
        assert set(want) == set(names)
        for n in names:
            assert list(got[n].shape) == list(want[n].shape), n
            np.testing.assert_array_equal(got[n], bf16_bits(want[n]), err_msg=f"rank {rank}: {n}")


def test_a_vocabulary_split_unlike_vllms_is_refused_by_name():
    config = {**QWEN2_KV1, "vocab_size": 100}  # our T = 2 split: 50 rows; vLLM's: 64
    switch = Switch.from_arrays(config, arrays(config), world=2, rollout_tp=2)
    with switch.rollout() as w:
        with pytest.raises(ConfigError, match="model.embed_tokens.weight.*rows 0..64"):
            dict(w.named_arrays("vllm"))
