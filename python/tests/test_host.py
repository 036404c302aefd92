"""The bridge on the CPU reference backend, with numpy arrays through DLPack."""

import json

import numpy as np
import pytest

import lifecycle
from lifecycle import (
    ConfigError,
    StaleWeightsError,
    Switch,
    TensorMismatchError,
    TensorsInUseError,
)
from support import bf16_bits


def rollout_bits(switch, rank=0):
    with switch.rollout() as w:
        return {h.name: np.from_dlpack(h).copy() for h in w.handles(rank, bits=True)}


def expected_slice(name, full, tp, rank):
    """The rank's slice under vLLM's splits (column: dim 0, row: dim 1, norms replicated;
    kv heads fewer than T replicated; this config's vocabulary 20 splits at T = 2)."""
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    if any(c in name for c in column) and not (("k_proj" in name or "v_proj" in name) and tp > 1):
        n = full.shape[0] // tp
        return full[rank * n : (rank + 1) * n]
    if ("o_proj" in name or "down_proj" in name) and full.ndim == 2:
        n = full.shape[1] // tp
        return full[:, rank * n : (rank + 1) * n]
    return full


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)])
def test_rollout_is_the_bf16_of_the_shards(config, params, world, tp):
    switch = Switch.from_arrays(config, params, world=world, rollout_tp=tp)
    full = dict(params)
    for rank in range(tp):
        got = rollout_bits(switch, rank)
        assert set(got) == set(full)
        for name, bits in got.items():
            want = bf16_bits(expected_slice(name, full[name], tp, rank))
            np.testing.assert_array_equal(bits, want, err_msg=name)


def test_a_degree_that_does_not_divide_the_world_is_refused_when_built(config, params):
    with pytest.raises(ConfigError, match="T = 2 does not divide the world size W = 3"):
        Switch.from_arrays(config, params, world=3, rollout_tp=2)


def test_short_and_empty_trailing_shards(config, params):
    # a [2, 8] tensor over W = 3: rows 0..1, 1..2 and none (FSDP2's chunks)
    norm = [(n, a) for n, a in params]
    switch = Switch.from_arrays(config, norm, world=3)
    shards = {s.name: s.shards for s in switch._sources}
    assert [len(s) for s in shards["model.embed_tokens.weight"]] == [7, 7, 6]
    assert [s.shape[0] for s in shards["model.layers.0.self_attn.k_proj.weight"]] == [2, 2, 0]
    got = rollout_bits(switch)
    np.testing.assert_array_equal(
        got["model.layers.0.self_attn.k_proj.weight"],
        bf16_bits(dict(params)["model.layers.0.self_attn.k_proj.weight"]),
    )


def test_the_shards_are_read_where_they_are(config, params):
    switch = Switch.from_arrays(config, params, world=2)
    src = switch._sources[0].shards[0]
    assert np.shares_memory(src, dict(params)[switch._sources[0].name])


def test_construction_errors_name_the_tensor(config, params):
    bad = [(n, a) for n, a in params if n != "lm_head.weight"]
    with pytest.raises(TensorMismatchError, match="lm_head.weight.*missing"):
        Switch.from_arrays(config, bad)
    wrong = [(n, a[:-1] if n == "model.norm.weight" else a) for n, a in params]
    with pytest.raises(TensorMismatchError, match=r"model.norm.weight.*\[8\].*\[7\]"):
        Switch.from_arrays(config, wrong)
    extra = params + [("model.layers.9.mlp.up_proj.weight", np.zeros((16, 8), np.float32))]
    with pytest.raises(TensorMismatchError, match="model.layers.9.mlp.up_proj.weight"):
        Switch.from_arrays(config, extra)
    f64 = [(n, a.astype(np.float64) if "q_proj" in n else a) for n, a in params]
    with pytest.raises(TensorMismatchError, match="q_proj.*fp32.*float64.*astype"):
        Switch.from_arrays(config, f64)
    with pytest.raises(ConfigError, match="dtype"):
        Switch.from_arrays(config, params, dtype="int4")
    with pytest.raises(ConfigError, match="not divisible"):
        Switch.from_arrays(config, params, rollout_tp=3)
    with pytest.raises(ConfigError, match="model_type"):
        Switch.from_arrays({**config, "model_type": "gpt9"}, params)
    with pytest.raises(lifecycle.LifecycleError):
        Switch.from_arrays(config, params, offload="sometimes")


def test_lazy_rollouts_switch_only_when_the_weights_are_written(config, params):
    switch = Switch.from_arrays(config, params)
    first = rollout_bits(switch)
    for _ in range(3):
        again = rollout_bits(switch)
        assert all((again[n] == first[n]).all() for n in first)
    stats = switch.stats()
    assert (stats["enters"], stats["refreshes"], stats["generation"]) == (1, 0, 1)
    # reading tensors is not a rollout call; a kept-resident refresh is not an exit
    assert (stats["reuses"], stats["exits"]) == (3, 0)
    q = "model.layers.0.self_attn.q_proj.weight"
    with switch.update() as m:
        m[q] *= 2  # in place
    again = rollout_bits(switch)
    assert switch.stats()["refreshes"] == 1 and switch.stats()["exits"] == 0
    np.testing.assert_array_equal(again[q], bf16_bits(dict(params)[q]))
    # a forced refresh switches with nothing written
    with switch.rollout(refresh=True):
        pass
    assert switch.stats()["refreshes"] == 2


def test_an_in_place_trainer_cannot_write_unseen(config, params):
    switch = Switch.from_arrays(config, params, world=2)
    q = dict(params)["model.layers.0.self_attn.q_proj.weight"]
    before = rollout_bits(switch)
    with pytest.raises(ValueError, match="read-only"):
        q *= 2  # outside update(): the array is the switch's
    with pytest.raises(ConfigError, match="update"):
        switch.masters["model.layers.0.self_attn.q_proj.weight"] = q * 2
    assert all((rollout_bits(switch)[n] == before[n]).all() for n in before)
    assert switch.stats()["generation"] == 1
    with switch.update() as m:
        m["model.layers.0.self_attn.q_proj.weight"] *= 2
    after = rollout_bits(switch)
    np.testing.assert_array_equal(after["model.layers.0.self_attn.q_proj.weight"], bf16_bits(q))
    assert switch.stats()["generation"] == 2


def test_a_rebinding_trainer_writes_through_the_switch(config, params):
    switch = Switch.from_arrays(config, params, world=3)
    name = "model.layers.1.mlp.down_proj.weight"
    p = dict(params)[name]
    for step in range(3):
        p = p - 0.5 * np.ones_like(p)  # a new array each step, as `p = p - lr * g` makes
        with switch.update() as m:
            m[name] = p
        got = rollout_bits(switch)
        np.testing.assert_array_equal(got[name], bf16_bits(p), err_msg=f"step {step}")
    assert switch.stats()["generation"] == 3
    with pytest.raises(TensorMismatchError, match=rf"{name}.*shape \[8, 8\] written"):
        with switch.update() as m:
            m[name] = np.zeros((8, 8), np.float32)


def test_shards_are_written_through_the_switch_too(config, params):
    world = 2
    shards = [(n, list(a.shape), [a[lo:hi].copy() for lo, hi in chunks(a, world)]) for n, a in params]
    switch = Switch.from_shards(config, shards, world=world)
    name, _, per_rank = shards[2]
    with pytest.raises(ValueError, match="read-only"):
        per_rank[0][...] = 0
    with switch.update() as m:
        for s in m[name]:
            s *= 3
    full = np.concatenate(per_rank)
    np.testing.assert_array_equal(rollout_bits(switch)[name], bf16_bits(full))
    with switch.update() as m:
        m[name] = np.zeros_like(full)  # a full array is cut into the ranks' chunks
    assert not rollout_bits(switch)[name].any()


def chunks(a, world):
    from lifecycle.sources import _chunks

    return _chunks(a.shape[0], world)


def test_update_and_rollout_exclude_each_other(config, params):
    switch = Switch.from_arrays(config, params)
    with switch.rollout() as w:
        with pytest.raises(ConfigError, match="rollout session is open"):
            with switch.update():
                pass
        list(w.handles())  # the session is intact
    with switch.update():
        with pytest.raises(ConfigError, match="update"):
            with switch.rollout():
                pass
    with switch.update() as m:
        kept = m
    with pytest.raises(StaleWeightsError, match="after their update"):
        kept["lm_head.weight"] = np.zeros((20, 8), np.float32)


def test_tensors_are_stale_after_their_session(config, params):
    switch = Switch.from_arrays(config, params)
    with switch.rollout() as w:
        h = w.handles(bits=True)[0]
        h.check_current()
    with pytest.raises(StaleWeightsError, match="model.embed_tokens.weight.*session ended"):
        np.from_dlpack(h)
    with pytest.raises(StaleWeightsError, match="session"):
        w.handles()
    # a new session is not the old one's
    with switch.rollout():
        with pytest.raises(StaleWeightsError):
            h.check_current()


def test_a_referenced_tensor_blocks_rewrites_and_exit(config, params):
    switch = Switch.from_arrays(config, params)
    with switch.rollout() as w:
        held = np.from_dlpack(w.handles(bits=True)[1])
    assert switch.held() == [switch._sources[1].name]
    switch.mark_changed()
    with pytest.raises(TensorsInUseError, match=switch._sources[1].name):
        with switch.rollout():
            pass
    with pytest.raises(TensorsInUseError, match="exit"):
        switch.train()
    before = held.copy()
    del held
    assert switch.held() == []
    with switch.rollout():
        pass
    switch.train()
    assert before.dtype == np.uint16


def test_fp8_rollout_has_scales(config, params):
    config = {**config, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2}
    rng = np.random.default_rng(1)
    params = [
        (n, rng.standard_normal(s).astype(np.float32))
        for n, s in lifecycle.expected_parameters(json.dumps(config))
    ]
    switch = Switch.from_arrays(config, params, dtype="fp8")
    with switch.rollout() as w:
        hs = {h.name: h for h in w.handles()}
    up = "model.layers.0.mlp.up_proj.weight"
    assert hs[up].dtype_name == "float8_e4m3fn"
    assert hs[up.replace(".weight", ".weight_scale_inv")].shape == [2, 1]
    assert hs["model.norm.weight"].dtype_name == "bfloat16"


def test_vllm_names_match_vllms_model_source():
    fixture = json.load(open(__file__.rsplit("/", 1)[0] + "/fixtures/vllm_runtime_names.json"))
    checked = 0
    for case in fixture["cases"]:
        if case["quant"] != "bf16" or not case["valid"]:
            continue
        cfg = dict(fixture["configs"][case["config"]]["hf_config"])
        cfg["architectures"] = [case["architecture"]]
        experts = "ep" if case["enable_expert_parallel"] else "tp"
        got = lifecycle.vllm_names(cfg, case["tensor_parallel_size"], experts=experts)
        assert [list(x) for x in got] == [[n, s] for n, s in case["params"]], case["id"]
        checked += 1
    assert checked >= 20


def test_eager_switching_enters_at_every_call(config, params):
    lazy = Switch.from_arrays(config, params)
    eager = Switch.from_arrays(config, params, switching="eager")
    for _ in range(3):
        a, b = rollout_bits(lazy), rollout_bits(eager)
        assert all((a[n] == b[n]).all() for n in a)
    assert (lazy.stats()["enters"], eager.stats()["enters"]) == (1, 3)
    assert eager.stats()["exits"] == 3
    with pytest.raises(ConfigError, match="switching"):
        Switch.from_arrays(config, params, switching="sometimes")


def test_a_cuda_switch_without_its_launch_or_gpu_is_a_clear_error(config, monkeypatch):
    names = lifecycle.expected_parameters(json.dumps(config))
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)

    def build(world):
        return lifecycle._lifecycle._Switch(
            json.dumps(config), names, world=world, tp=1, dtype_name="bf16",
            experts_name="tp", offload="none", switching="lazy", device="cuda",
        )

    with pytest.raises(ConfigError, match="one process per GPU.*torchrun"):
        build(2)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:  # no GPU or no driver: an exception, never a crash
        with pytest.raises(lifecycle.LifecycleError):
            build(1)


def test_a_rank_beyond_the_rollout_is_refused(config, params):
    switch = Switch.from_arrays(config, params, world=2, rollout_tp=2)
    assert switch._s.local_ranks() == [0, 1]
    with switch.rollout() as w:
        with pytest.raises(ConfigError, match="rollout rank 2: the rollout has T = 2"):
            w.handles(2)


def test_a_closed_switch_is_refused_and_close_waits_for_held_tensors(config, params):
    switch = Switch.from_arrays(config, params)
    with switch.rollout() as w:
        kept = np.from_dlpack(w.handles(bits=True)[0])
    with pytest.raises(TensorsInUseError):
        switch.close()
    del kept
    switch.close()
    switch.close()  # twice is fine
    with pytest.raises(ConfigError, match="closed"):
        with switch.rollout():
            pass


def test_engine_settings_are_checked_before_the_switch_is_asked(config, params):
    from lifecycle.engine import Engine

    switch = Switch.from_arrays(config, params, dtype="fp8")
    with pytest.raises(ConfigError, match="fp8_compute.*weight-only or w8a8"):
        Engine(switch, max_sequences=1, max_tokens=8, fp8_compute="int8")
    with pytest.raises(ConfigError, match="kv_dtype.*expected bf16, f32 or fp8"):
        Engine(switch, max_sequences=1, max_tokens=8, kv_dtype="f16")
    with pytest.raises(ConfigError, match="lora_mode.*expected unmerged or merged"):
        Engine(switch, max_sequences=1, max_tokens=8, lora_mode="fused")
    with pytest.raises(ConfigError, match="max_sequences"):
        Engine(switch, max_sequences=0, max_tokens=8)
    with pytest.raises(ConfigError, match="kv_tokens: expected a positive integer"):
        Engine(switch, max_sequences=1, max_tokens=8, kv_tokens=0)
    with pytest.raises(ConfigError, match="kv_tokens 7 cannot hold one sequence of max_tokens 8"):
        Engine(switch, max_sequences=1, max_tokens=8, kv_tokens=7)
    # a valid setting reaches the switch, which is not a GPU one
    with pytest.raises(ConfigError, match="GPU engine needs a switch on device"):
        Engine(switch, max_sequences=1, max_tokens=8, fp8_compute="w8a8")
    with pytest.raises(ConfigError, match="GPU engine needs a switch on device"):
        Engine(switch, max_sequences=1, max_tokens=8, kv_dtype="fp8")
    with pytest.raises(ConfigError, match="GPU engine needs a switch on device"):
        Engine(switch, max_sequences=4, max_tokens=8, kv_tokens=16)


def fp8_config_and_params(config):
    config = {**config, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2}
    rng = np.random.default_rng(1)
    params = [
        (n, rng.standard_normal(s).astype(np.float32))
        for n, s in lifecycle.expected_parameters(json.dumps(config))
    ]
    return config, params


def test_fp8_keep_leaves_the_chosen_matrices_bf16(config):
    config, params = fp8_config_and_params(config)
    dtypes = {}
    for keep in ("none", "attention", "layer:1", "attention, layer:0"):
        switch = Switch.from_arrays(config, params, dtype="fp8", fp8_keep=keep)
        with switch.rollout() as w:
            dtypes[keep] = {h.name: h.dtype_name for h in w.handles()}
    fp8 = lambda keep: {  # noqa: E731
        n for n, d in dtypes[keep].items() if d == "float8_e4m3fn"
    }
    matrices = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert fp8("none") == matrices
    assert fp8("attention") == {n for n in matrices if ".mlp." in n}
    assert fp8("layer:1") == {n for n in matrices if n.startswith("model.layers.0.")}
    assert fp8("attention, layer:0") == {n for n in fp8("attention") if "layers.1." in n}
    # a kept matrix has no scales
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" not in dtypes["attention"]
    assert "model.layers.0.mlp.up_proj.weight_scale_inv" in dtypes["attention"]


def test_fp8_keep_is_checked_before_anything_moves(config):
    config, params = fp8_config_and_params(config)
    cases = [
        ("layer:2", "fp8", r"fp8_keep layer:2: the model's decoder layers are numbered 0 to 1; name one of those"),
        ("mlp", "fp8", r"fp8_keep `mlp`: expected attention, layer:N or none"),
        ("attention", "bf16", r"fp8_keep `attention` keeps matrices of an fp8 rollout bf16"),
    ]
    for keep, dtype, message in cases:
        with pytest.raises(ConfigError, match=message):
            Switch.from_arrays(config, params, dtype=dtype, fp8_keep=keep)


def test_switches_over_the_same_arrays_see_each_others_writes(config, params):
    a = Switch.from_arrays(config, params)
    b = Switch.from_arrays(config, params, world=2, dtype="bf16")
    name = "model.layers.0.mlp.up_proj.weight"
    first = rollout_bits(b)
    with a.update() as m:
        m[name] *= -1
    assert not (rollout_bits(b)[name] == first[name]).all()
    np.testing.assert_array_equal(rollout_bits(b)[name], bf16_bits(dict(params)[name]))
    array = dict(params)[name]
    a.close()
    assert not array.flags.writeable  # b still holds it
    b.close()
    assert array.flags.writeable  # the trainer's again
    c = Switch.from_arrays(config, params)
    assert not array.flags.writeable
    del c
    import gc

    gc.collect()
    assert array.flags.writeable  # a collected switch lets go too
