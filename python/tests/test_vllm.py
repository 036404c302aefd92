"""vLLM's runtime names, shapes and fused contents, from the host backend's rollout."""

import json

import numpy as np
import pytest

import lifecycle
from lifecycle import ConfigError, Switch
from support import bf16_bits, block_scales, e4m3_values

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


# fp8: every part of a fused tensor fills whole 128-row blocks (head_dim 128)
QWEN2_FP8 = {
    "model_type": "qwen2", "vocab_size": 128, "hidden_size": 256, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}
QWEN3_MOE_FP8 = {
    "model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128,
    "intermediate_size": 256, "rope_theta": 10000.0, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 128, "mlp_only_layers": [0],
    "tie_word_embeddings": True,
}


def test_fp8_vllm_names_match_vllms_model_source_with_the_router_bf16():
    fixture = json.load(open(__file__.rsplit("/", 1)[0] + "/fixtures/vllm_runtime_names.json"))
    checked = refused = 0
    for case in fixture["cases"]:
        if case["quant"] != "fp8_block128":
            continue
        cfg = dict(fixture["configs"][case["config"]]["hf_config"])
        cfg["architectures"] = [case["architecture"]]
        tp, experts = case["tensor_parallel_size"], "ep" if case["enable_expert_parallel"] else "tp"
        if not case["valid"]:
            with pytest.raises(ConfigError, match="not a multiple of 128"):
                lifecycle.vllm_names(cfg, tp, experts=experts, dtype="fp8")
            refused += 1
            continue
        got = lifecycle.vllm_names(cfg, tp, experts=experts, dtype="fp8")
        # the fixture quantises the router (ignored_layers=[]); the rollout keeps it bf16, as
        # Qwen's fp8 checkpoints list it in ignored_layers
        want = [[n, s] for n, s in case["params"] if not n.endswith("mlp.gate.weight_scale_inv")]
        assert [list(x) for x in got] == want, case["id"]
        checked += 1
    assert (checked, refused) == (14, 8)
    with pytest.raises(ConfigError, match='dtype: `int8` is not a rollout dtype: expected "bf16" or "fp8"'):
        lifecycle.vllm_names(QWEN2_FP8, dtype="int8")
    with pytest.raises(ConfigError, match='experts: `dp`: expected "tp"'):
        lifecycle.vllm_names(QWEN3_MOE_FP8, 2, experts="dp")


@pytest.mark.parametrize(
    "config,tp,experts",
    [(QWEN2_FP8, 1, "tp"), (QWEN2_FP8, 2, "tp"), (QWEN3_MOE_FP8, 1, "tp"),
     (QWEN3_MOE_FP8, 2, "ep")],
)
def test_fp8_vllm_format_is_vllms_block_grid_of_the_masters(config, tp, experts):
    params = arrays(config)
    full = dict(params)
    switch = Switch.from_arrays(
        config, params, world=2, rollout_tp=tp, experts=experts, dtype="fp8"
    )
    names = lifecycle.vllm_names(config, tp, experts=experts, dtype="fp8")
    for rank in range(tp):
        with switch.rollout() as w:
            got = {n: np.array(a) for n, a in w.named_arrays("vllm", rank)}
        want = expected(config, full, tp, rank, experts)
        assert [(n, list(got[n].shape)) for n in got] == [(n, s) for n, s in names]
        fp8 = [n for n in got if n + "_scale_inv" in got]
        assert len(fp8) == (4 if config is QWEN2_FP8 else 8), fp8
        for n in got:
            if n.endswith("_scale_inv"):
                continue
            if n not in fp8:
                np.testing.assert_array_equal(got[n], bf16_bits(want[n]), err_msg=n)
                continue
            assert got[n].dtype == np.uint8 and got[n + "_scale_inv"].dtype == np.float32, n
            x = want[n] if want[n].ndim == 3 else want[n][None]
            q = got[n].reshape(x.shape)
            blocks = (x.shape[0], -(-x.shape[1] // 128), -(-x.shape[2] // 128))
            s = got[n + "_scale_inv"].reshape(blocks)
            for e in range(x.shape[0]):
                # the scales are the block formula over vLLM's fused rows of the masters
                np.testing.assert_array_equal(s[e], block_scales(x[e]), err_msg=f"{n} [{e}]")
                # and each byte is its master within e4m3's half step
                deq = e4m3_values(q[e]) * np.repeat(np.repeat(s[e], 128, 0), 128, 1)[
                    : x.shape[1], : x.shape[2]
                ]
                err = np.abs(deq - x[e])
                assert (err <= np.abs(x[e]) / 16 + 2.0**-10 * s[e].max()).all(), n


def test_fp8_parts_that_share_a_block_of_the_fused_grid_are_refused_by_name():
    # head_dim 64: k and v hold 64 rows each, which vLLM's fused grid would put in one block
    config = {**QWEN2_FP8, "num_attention_heads": 4}
    switch = Switch.from_arrays(config, arrays(config), dtype="fp8")
    with switch.rollout() as w:
        hf = dict(w.named_arrays("hf"))
        assert "model.layers.0.self_attn.k_proj.weight_scale_inv" in hf
        with pytest.raises(
            ConfigError, match=r"qkv_proj.weight: fp8 rows 0..64 of model.layers.0.self_attn.k_proj"
        ):
            dict(w.named_arrays("vllm"))


def test_fp8_vllm_format_of_a_rollout_keeping_attention_bf16():
    switch = Switch.from_arrays(
        QWEN2_FP8, arrays(QWEN2_FP8), dtype="fp8", fp8_keep="attention"
    )
    with switch.rollout() as w:
        got = dict(w.named_arrays("vllm"))
    p = "model.layers.0."
    assert got[p + "self_attn.qkv_proj.weight"].dtype == np.uint16
    assert got[p + "self_attn.o_proj.weight"].dtype == np.uint16
    assert not any(n.startswith(p + "self_attn.") and n.endswith("_scale_inv") for n in got)
    assert got[p + "mlp.gate_up_proj.weight"].dtype == np.uint8
    assert got[p + "mlp.gate_up_proj.weight_scale_inv"].shape == (4, 2)
    assert got[p + "mlp.down_proj.weight_scale_inv"].shape == (2, 2)
