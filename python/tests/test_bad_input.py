"""The package's bad inputs (docs/bad-input.md, the Python rows): each raises its named exception
at the documented point, with a message that says what was expected, what was found and what
to do, and leaves everything as it was: the masters' checksum, the generation, `held()` and
the next rollout's bits."""

import json
import pathlib
import zlib

import numpy as np
import pytest

import lifecycle
from lifecycle import (
    ConfigError,
    Engine,
    NonFiniteError,
    StaleWeightsError,
    Switch,
    TensorMismatchError,
    TensorsInUseError,
)
from support import bf16_bits


def rollout_bits(switch):
    with switch.rollout() as w:
        return {h.name: np.from_dlpack(h).copy() for h in w.handles(bits=True)}


def snapshot(switch, params):
    """What must not move when an input is refused."""
    checksum = [zlib.crc32(np.ascontiguousarray(a).tobytes()) for _, a in params]
    return checksum, switch.stats()["generation"], switch.held()


def assert_intact(switch, params, before):
    assert snapshot(switch, params) == before
    got = rollout_bits(switch)
    for n, a in params:
        np.testing.assert_array_equal(got[n], bf16_bits(a), err_msg=n)


def refused(exc, pattern, call):
    with pytest.raises(exc, match=pattern) as e:
        call()
    message = str(e.value)
    assert len(message) < 400, f"{len(message)} characters: {message}"
    assert "  " not in message, f"stray spaces: {message!r}"
    return message


# ---- at construction ------------------------------------------------------------------------


def test_arrays_of_the_wrong_kind_are_refused_when_the_switch_is_built(config, params):
    q = "model.layers.0.self_attn.q_proj.weight"

    def with_q(value):
        return [(n, value if n == q else a) for n, a in params]

    full = dict(params)[q]
    cases = [
        (with_q(full.astype(np.float64)), rf"`{q}`: fp32 training weights expected, found dtype float64: pass a.astype"),
        (with_q(np.asfortranarray(np.repeat(full, 2, 1))[:, ::2]), rf"`{q}`: its shard is not C-contiguous: pass np.ascontiguousarray"),
        (with_q(full.tolist()), rf"`{q}`: a numpy array or a torch tensor expected, found list: pass np.asarray"),
        (with_q({"w": full}), rf"`{q}`: a numpy array or a torch tensor expected, found dict"),
        (
            with_q(np.frombuffer(full.tobytes(), np.float32).reshape(full.shape)),
            rf"`{q}`: numpy cannot make this array writable again .*pass a.copy\(\)",
        ),
    ]
    for named, pattern in cases:
        refused(TensorMismatchError, pattern, lambda: Switch.from_arrays(config, named))
    # nothing was taken: the arrays stay the caller's, writable
    assert all(a.flags.writeable for _, a in params)


def test_bad_settings_are_refused_when_the_switch_is_built(config, params):
    cases = [
        (dict(world=0), ConfigError, r"world: expected a positive integer \(the trainer's FSDP world size W\), found 0"),
        (dict(world=-1), ConfigError, r"world: expected a positive integer .*found -1"),
        (dict(world="2"), ConfigError, r"world: expected a positive integer .*found str '2'"),
        (dict(world=2.0), ConfigError, r"world: expected a positive integer .*found float 2.0"),
        (dict(rollout_tp=0), ConfigError, r"rollout_tp: expected a positive integer .*found 0"),
        (dict(world=3, rollout_tp=2), ConfigError, r"T = 2 does not divide the world size W = 3: choose T among the divisors of 3 \(1, 3\)"),
        (dict(rollout_tp=3), ConfigError, "not divisible"),
        (dict(dtype="int4"), ConfigError, r'dtype: `int4` is not a rollout dtype: expected "bf16" or "fp8"'),
        (dict(dtype=8), ConfigError, "dtype: expected a string, found int"),
        (dict(experts="dp"), ConfigError, r'experts: `dp`: expected "tp"'),
        (dict(offload="sometimes"), ConfigError, r'offload: `sometimes`: expected "none"'),
        (dict(switching="sometimes"), ConfigError, "switching"),
    ]
    for settings, exc, pattern in cases:
        refused(exc, pattern, lambda: Switch.from_arrays(config, params, **settings))


def test_bad_shards_are_refused_when_the_switch_is_built(config, params):
    name, a = params[0]
    refused(
        ConfigError,
        r"world: expected a positive integer .*found -1",
        lambda: Switch.from_shards(config, [(name, a.shape, [])], world=-1),
    )
    refused(
        TensorMismatchError,
        rf"`{name}`: 1 shards given, the world has 2 ranks",
        lambda: Switch.from_shards(config, [(name, a.shape, [a])], world=2),
    )
    # the ranks' rows are FSDP2's chunks: 10 and 10 rows of 20, not 12 and 8
    shards = [(n, x.shape, [x[: -(-len(x) // 2)], x[-(-len(x) // 2):]]) for n, x in params]
    shards[0] = (name, a.shape, [a[:12], a[12:]])
    refused(
        TensorMismatchError,
        rf"`{name}`: rank 0 of 2 holds rows 0..10 of shape \[20, 8\] \(80 fp32 elements",
        lambda: Switch.from_shards(config, shards, world=2),
    )
    refused(
        ConfigError,
        "shards: expected tuples, found str",
        lambda: Switch.from_shards(config, ["lm_head.weight"], world=1),
    )


def test_bad_configs_and_names_are_refused_when_the_switch_is_built(config, params, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    refused(
        ConfigError,
        r"a string is read as JSON text, and .* is not JSON; to read the file pass pathlib.Path",
        lambda: Switch.from_arrays(str(path), params),
    )
    Switch.from_arrays(pathlib.Path(path), params).close()  # a Path is read
    refused(ConfigError, "config: expected a Hugging Face config", lambda: Switch.from_arrays(3, params))
    refused(ConfigError, "model_type", lambda: Switch.from_arrays({**config, "model_type": "gpt9"}, params))
    one = [(n, a) for n, a in params if n != "lm_head.weight"]
    refused(
        TensorMismatchError,
        r"`lm_head.weight`: missing from the module: pass every parameter",
        lambda: Switch.from_arrays(config, one),
    )
    two = [(n, a) for n, a in one if n != "model.norm.weight"]
    refused(
        TensorMismatchError,
        r"missing from the module, with 1 more of the model's parameters",
        lambda: Switch.from_arrays(config, two),
    )
    refused(ConfigError, "named: expected tuples, found str", lambda: Switch.from_arrays(config, ["x"]))
    with pytest.raises(ConfigError, match="from_fsdp2, Switch.from_peft, Switch.from_megatron, Switch.from_arrays or Switch.from_shards"):
        Switch(config, [])


def test_a_dict_of_arrays_is_accepted(config, params):
    a, b = rollout_bits(Switch.from_arrays(config, dict(params))), rollout_bits(Switch.from_arrays(config, params))
    assert all((a[n] == b[n]).all() for n in a)


# ---- at the switch --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_masters_are_refused_at_the_switch(config, params, dtype, bad):
    if dtype == "fp8":
        config = {**config, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2}
        rng = np.random.default_rng(1)
        params = [(n, rng.standard_normal(s).astype(np.float32)) for n, s in lifecycle.expected_parameters(json.dumps(config))]
    switch = Switch.from_arrays(config, params, world=2, dtype=dtype)
    good = rollout_bits(switch)
    name = "model.layers.1.mlp.up_proj.weight"
    with switch.update() as m:
        m[name][3, 5] = bad
    generation, held = switch.stats()["generation"], switch.held()
    message = refused(
        NonFiniteError,
        rf"(?i)`{name}` holds a non-finite value \({bad} at element \d+ of rank 0's shard \(of 2\)\)",
        lambda: rollout_bits(switch),
    )
    assert "fix the training step" in message
    assert (switch.stats()["generation"], switch.held()) == (generation, held)
    refused(NonFiniteError, name, lambda: rollout_bits(switch))  # still refused, nothing rolled out
    with switch.update() as m:
        m[name][3, 5] = 0.25
    again = rollout_bits(switch)
    assert switch.stats()["generation"] == generation + 1
    others = [n for n in good if not n.startswith(name.removesuffix(".weight"))]
    assert all((again[n] == good[n]).all() for n in others)
    if dtype == "bf16":
        np.testing.assert_array_equal(again[name], bf16_bits(dict(params)[name]))


# ---- calls on a built switch ----------------------------------------------------------------


def test_engine_on_a_cpu_switch_is_refused_without_leaving_rollout_mode(config, params):
    switch = Switch.from_arrays(config, params)
    before = snapshot(switch, params)
    with switch.rollout():
        pass
    stats = switch.stats()
    refused(ConfigError, r'GPU engine needs a switch on device "cuda"; this one is on "cpu"', lambda: Engine(switch, max_sequences=1, max_tokens=8))
    refused(ConfigError, r"max_sequences: expected a positive integer", lambda: Engine(switch, max_sequences=0, max_tokens=8))
    assert switch.stats() == stats  # nothing released
    with switch.rollout():
        pass
    assert switch.stats()["reuses"] == stats["reuses"] + 1 and switch.stats()["enters"] == 1
    assert before[0] == snapshot(switch, params)[0]


def test_calls_after_close(config, params):
    switch = Switch.from_arrays(config, params)
    with switch.rollout() as w:
        pass
    switch.close()
    switch.close()  # a second close does nothing
    assert switch.closed and switch.held() == []
    for call in (
        switch.train,
        switch.mark_changed,
        switch.stats,
        lambda: switch.masters,
        lambda: w.generation,
        lambda: switch.rollout().__enter__(),
        lambda: switch.update().__enter__(),
    ):
        refused(ConfigError, r"this switch is closed \(close\(\) freed its memory\): build a new one", call)
    # the arrays are the caller's again
    params[0][1][0, 0] = 1.0


def test_a_long_list_of_held_tensors_is_summarised(config):
    config = {**config, "num_hidden_layers": 48}
    rng = np.random.default_rng(3)
    params = [(n, rng.standard_normal(s).astype(np.float32)) for n, s in lifecycle.expected_parameters(json.dumps(config))]
    switch = Switch.from_arrays(config, params)
    with switch.rollout() as w:
        kept = dict(w.named_arrays())
    message = refused(TensorsInUseError, r"exit would rewrite or free the rollout weights while 579 handed-out tensors are still referenced \(e.g. .*`switch.held\(\)` lists them\)", switch.train)
    assert len(switch.held()) == len(params) == 579
    refused(TensorsInUseError, "close would rewrite", switch.close)
    assert not switch.closed
    with switch.update() as m:
        m["lm_head.weight"] *= 1.0
    refused(TensorsInUseError, "entering with changed weights", lambda: rollout_bits(switch))
    del kept, message
    switch.close()


def test_bad_calls_in_a_session(config, params):
    switch = Switch.from_arrays(config, params, world=2, rollout_tp=2)
    before = snapshot(switch, params)
    with switch.rollout() as w:
        refused(ConfigError, "rollout rank 2: the rollout has T = 2 ranks", lambda: w.handles(2))
        refused(ConfigError, "rank: expected an int", lambda: w.handles("0"))
        refused(ConfigError, r'format `safetensors`: expected "hf", "vllm" or "peft"', lambda: list(w.named_arrays("safetensors")))
        refused(ConfigError, "a rollout session is already open", lambda: switch.rollout().__enter__())
        refused(ConfigError, "a rollout session is open: end it before training", switch.train)
        refused(ConfigError, "a rollout session is open: end it before updating", lambda: switch.update().__enter__())
    refused(StaleWeightsError, "session ended", w.handles)
    with switch.update() as m:
        refused(TensorMismatchError, r"`lm\.head`: not one of the switch's 27 tensors", lambda: m["lm.head"])
        refused(TensorMismatchError, r"`lm_head.weight`: shape \[3\] written, its shape is \[20, 8\]", lambda: m.__setitem__("lm_head.weight", np.zeros(3)))
        refused(TensorMismatchError, r"floating-point values expected, found int64", lambda: m.__setitem__("lm_head.weight", np.zeros((20, 8), np.int64)))
    assert before[0] == snapshot(switch, params)[0]


def test_an_in_place_write_outside_update_is_numpys_read_only_error(config, params):
    switch = Switch.from_arrays(config, params)
    before = snapshot(switch, params)
    with pytest.raises(ValueError, match="read-only"):
        params[0][1][0] += 1.0
    with pytest.raises(ValueError, match="read-only"):
        params[1][1][...] = 0.0
    assert_intact(switch, params, before)


def test_engine_arguments_are_checked_before_anything_runs():
    """P13 (types): engine.generate's arguments are checked before the engine is asked (its
    ranges are checked in Rust with the requests: models/decoder/tests/continuous.rs, and on a
    GPU in gpu/test_fsdp2.py)."""
    from lifecycle.engine import Engine

    asked = []

    class Live:
        def seed_of(self, seed, index):
            return seed * 1000 + index

        def run(self, *args):
            asked.append(args)
            return [([1], [-0.5], [-0.5], [0.0], "length", [0]) for _ in args[0]]

    class FakeSwitch:
        def _live(self):
            return Live()

    class Weights:
        def _check(self, what):
            pass

    engine = object.__new__(Engine)
    engine._switch = FakeSwitch()
    w = Weights()
    w._switch = engine._switch
    prompts = [[1, 2], [3], [4, 5, 6]]
    for kwargs, message in [
        (dict(max_new_tokens=[4, 4]), "max_new_tokens: expected one value or 3 (one per prompt), found 2"),
        (dict(max_new_tokens=2.5), "max_new_tokens: expected a non-negative integer, found float 2.5"),
        (dict(max_new_tokens=-1), "max_new_tokens: expected a non-negative integer, found -1"),
        (dict(max_new_tokens=4, temperature="hot"), "temperature: expected a number, found str 'hot'"),
        (dict(max_new_tokens=4, top_k=1.5), "top_k: expected a non-negative integer, found float 1.5"),
        (dict(max_new_tokens=4, stop_tokens=[1, "x"]), "stop_tokens[1]: expected a non-negative integer"),
        (dict(max_new_tokens=4, stop_tokens=7), "stop_tokens: expected a sequence of token ids, found int"),
        (dict(max_new_tokens=4, seed=[1, 2]), "seed: expected one value or 3 (one per prompt), found 2"),
    ]:
        with pytest.raises(lifecycle.ConfigError) as e:
            engine.generate(w, prompts, **kwargs)
        assert message in str(e.value), (kwargs, str(e.value))
    with pytest.raises(lifecycle.ConfigError, match=r"prompts\[1\]\[0\]: expected a non-negative integer"):
        engine.generate(w, [[1], [2.0]], max_new_tokens=3)
    assert asked == []
    # well-formed arguments reach the extension as it takes them
    out = engine.generate(w, prompts, max_new_tokens=[1, 2, 3], top_k=5, stop_tokens=(9,), seed=7)
    assert asked == [(prompts, [1, 2, 3], 0.0, 1.0, 5, [9], [7000, 7001, 7002])]
    assert [s.finish_reason for s in out] == ["length"] * 3
    assert out[0].logprobs.dtype == np.float32 and out[0].tokens == [1]


def test_group_stream_settings_are_checked():
    """P13 (streams): a GroupStream's settings are checked when it is made."""
    from lifecycle import GroupStream

    for kwargs, message in [
        (dict(leftovers="later"), 'leftovers: expected "abort" or "partial", found "later"'),
        (dict(max_staleness=2), "max_staleness bounds partial rollouts"),
        (dict(temperature="1"), "temperature: expected a number, found str '1'"),
        (dict(stop_tokens=3), "stop_tokens: expected a sequence of token ids, found int"),
    ]:
        with pytest.raises(lifecycle.ConfigError) as e:
            GroupStream(None, 4, max_new_tokens=8, **kwargs)
        assert message in str(e.value), (kwargs, str(e.value))
    with pytest.raises(lifecycle.ConfigError, match="group_size: expected a positive integer, found 0"):
        GroupStream(None, 0, max_new_tokens=8)
    GroupStream(None, 4, max_new_tokens=8, leftovers="partial", max_staleness=2)
