"""LoRA models on the host switch (CI, numpy): the adapters beside their frozen base, split as
their base is, refreshed alone; whole tensors trained beside them (PEFT's modules_to_save,
bias="all" / "lora_only") refreshed with them; PEFT's keys out; a written base and bad
configurations refused by name."""

from types import SimpleNamespace

import numpy as np
import pytest
from support import bf16_bits

import lifecycle

CONFIG = {
    "model_type": "qwen2", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
    "rope_theta": 1e4, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def arrays(lora=LORA, seed=0):
    rng = np.random.default_rng(seed)
    return {
        n: rng.standard_normal(s).astype(np.float32)
        for n, s in lifecycle.expected_parameters(CONFIG, lora=lora)
    }


def test_adapters_follow_their_bases_in_peft_names_and_shapes():
    names = lifecycle.expected_parameters(CONFIG, lora=LORA)
    plain = lifecycle.expected_parameters(CONFIG)
    adapters = [(n, s) for n, s in names if ".lora_" in n]
    # q, v, down on 2 layers: A and B each
    assert len(adapters) == 12 and len(names) == len(plain) + 12
    at = [n for n, _ in names].index("model.layers.1.mlp.down_proj.weight")
    assert names[at + 1] == ("model.layers.1.mlp.down_proj.lora_A.weight", [2, 32])
    assert names[at + 2] == ("model.layers.1.mlp.down_proj.lora_B.weight", [16, 2])
    # a PEFT LoraConfig (attributes; targets a set) reads as the dict does
    peft = SimpleNamespace(r=2, lora_alpha=4, target_modules={"down_proj", "v_proj", "q_proj"})
    assert lifecycle.expected_parameters(CONFIG, lora=peft) == names


def test_a_refresh_moves_the_adapters_alone_split_as_their_bases():
    a = arrays()
    s = lifecycle.Switch.from_arrays(CONFIG, a, lora=LORA, world=2, rollout_tp=2)
    with s.rollout() as w:
        before = [{n: x.copy() for n, x in w.named_arrays(rank=r)} for r in range(2)]
    # column-parallel q: B split on its rows, A whole; row-parallel down: A split on its columns
    q = "model.layers.0.self_attn.q_proj"
    down = "model.layers.1.mlp.down_proj"
    for r in range(2):
        assert np.array_equal(before[r][f"{q}.lora_A.weight"], bf16_bits(a[f"{q}.lora_A.weight"]))
        assert np.array_equal(
            before[r][f"{q}.lora_B.weight"], bf16_bits(a[f"{q}.lora_B.weight"][8 * r : 8 * r + 8])
        )
        assert np.array_equal(
            before[r][f"{down}.lora_A.weight"],
            bf16_bits(a[f"{down}.lora_A.weight"][:, 16 * r : 16 * r + 16]),
        )
    old = a[f"{q}.lora_B.weight"].copy()
    with s.update() as m:
        m[f"{q}.lora_B.weight"] += 1.0  # the switch's masters are the arrays given: `a` too
    with s.rollout() as w:
        after = [{n: x.copy() for n, x in w.named_arrays(rank=r)} for r in range(2)]
    assert s.stats()["refreshes"] == 1
    for r in range(2):
        changed = [n for n in before[r] if not np.array_equal(before[r][n], after[r][n])]
        assert changed == [f"{q}.lora_B.weight"]
        want = bf16_bits((old + 1.0)[8 * r : 8 * r + 8])
        assert np.array_equal(after[r][f"{q}.lora_B.weight"], want)


def test_peft_format_yields_the_adapters_alone_under_peft_keys():
    s = lifecycle.Switch.from_arrays(CONFIG, arrays(), lora=LORA)
    with s.rollout() as w:
        peft = dict(w.named_arrays("peft"))
        hf = dict(w.named_arrays())
        assert sorted(peft) == sorted(
            "base_model.model." + n for n in hf if n.endswith((".lora_A.weight", ".lora_B.weight"))
        )
        assert len(peft) == 12
        del peft, hf
    plain = lifecycle.Switch.from_arrays(CONFIG, arrays(lora=None))
    with plain.rollout() as w:
        with pytest.raises(lifecycle.ConfigError, match="has none"):
            list(w.named_arrays("peft"))


def test_a_written_base_is_refused_by_name_and_nothing_stays_half_switched():
    s = lifecycle.Switch.from_arrays(CONFIG, arrays(), lora=LORA)
    with s.rollout():
        pass
    with s.update() as m:
        m["model.layers.1.self_attn.v_proj.weight"] += 1.0
    with pytest.raises(lifecycle.LifecycleError, match=r"v_proj.weight.*frozen"):
        with s.rollout():
            pass
    # back in train mode: a new enter casts the base again
    with s.rollout() as w:
        got = dict(w.named_arrays())["model.layers.1.self_attn.v_proj.weight"]
        assert np.array_equal(got, bf16_bits(s.masters["model.layers.1.self_attn.v_proj.weight"]))
        del got


def test_bad_lora_configurations_and_adapter_tensors_are_refused_by_name():
    a = arrays()
    with pytest.raises(lifecycle.ConfigError, match="target_modules.*lm_head"):
        lifecycle.Switch.from_arrays(CONFIG, a, lora={**LORA, "target_modules": ["lm_head"]})
    with pytest.raises(lifecycle.ConfigError, match="r: expected"):
        lifecycle.Switch.from_arrays(CONFIG, a, lora={**LORA, "r": 2.5})
    with pytest.raises(lifecycle.ConfigError, match="r must be at least 1"):
        lifecycle.expected_parameters(CONFIG, lora={**LORA, "r": 0})
    with pytest.raises(lifecycle.TensorMismatchError, match="v_proj.lora_A.*missing"):
        lifecycle.Switch.from_arrays(
            CONFIG, {n: x for n, x in a.items() if "v_proj.lora_A" not in n}, lora=LORA
        )
    with pytest.raises(lifecycle.TensorMismatchError, match="no LoRA configuration"):
        lifecycle.Switch.from_arrays(CONFIG, a)
    with pytest.raises(lifecycle.TensorMismatchError, match="does not target"):
        lifecycle.Switch.from_arrays(CONFIG, a, lora={**LORA, "target_modules": ["q_proj"]})
    wrong = dict(a)
    wrong["model.layers.0.self_attn.q_proj.lora_B.weight"] = np.zeros((16, 3), np.float32)
    with pytest.raises(lifecycle.TensorMismatchError, match=r"q_proj.lora_B.weight.*\[16, 2\]"):
        lifecycle.Switch.from_arrays(CONFIG, wrong, lora=LORA)


def test_a_peft_models_parameter_names_map_onto_the_switchs():
    """``Switch.from_peft`` reads a PEFT model's parameters under the model's names: PEFT's
    wrapper prefix dropped, a LoRA layer's ``base_layer`` folded, the adapter's matrices as
    ``lora_A.weight`` / ``lora_B.weight``, a modules_to_save copy as the module's tensor, its
    frozen original left out; another adapter's matrices and copies refused by name."""
    from lifecycle._lora import peft_name

    p = "base_model.model.model.layers.2."
    assert peft_name(p + "self_attn.v_proj.base_layer.weight") == "model.layers.2.self_attn.v_proj.weight"
    assert peft_name(p + "self_attn.v_proj.base_layer.bias") == "model.layers.2.self_attn.v_proj.bias"
    assert peft_name(p + "mlp.up_proj.lora_A.default.weight") == "model.layers.2.mlp.up_proj.lora_A.weight"
    assert peft_name(p + "mlp.up_proj.lora_B.mine.weight", "mine") == (
        "model.layers.2.mlp.up_proj.lora_B.weight"
    )
    assert peft_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert peft_name("base_model.model.model.norm.weight") == "model.norm.weight"
    with pytest.raises(lifecycle.ConfigError, match="adapter `other`"):
        peft_name(p + "mlp.up_proj.lora_A.other.weight")
    # modules_to_save: the adapter's trained copy is the module's tensor, PEFT's frozen original
    # beside it is not switched, another adapter's copy is refused by name
    assert peft_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert peft_name("base_model.model.model.embed_tokens.modules_to_save.mine.weight", "mine") == (
        "model.embed_tokens.weight"
    )
    assert peft_name("base_model.model.lm_head.original_module.weight") is None
    assert peft_name("base_model.model.model.embed_tokens.original_module.weight") is None
    with pytest.raises(lifecycle.ConfigError, match="`base_model.model.lm_head.modules_to_save.other.weight`.*adapter `other`"):
        peft_name("base_model.model.lm_head.modules_to_save.other.weight")
    # transformers' fused experts adapted by PEFT (`mlp.experts.lora_A`), or one expert's linear
    for name in ("mlp.experts.lora_A.default.weight", "mlp.experts.3.down_proj.lora_B.default.weight"):
        with pytest.raises(lifecycle.ConfigError, match=f"`{p + name}`.*experts"):
            peft_name(p + name)


def test_from_peft_refuses_adapters_on_parameters_by_name():
    """PEFT's ``target_parameters`` (adapters on parameters such as a mixture-of-experts
    layer's fused experts) are refused before anything is read."""
    lora = SimpleNamespace(r=4, lora_alpha=8, target_modules=set(), target_parameters=["down_proj"],
                           modules_to_save=None, bias="none", use_rslora=False)
    model = SimpleNamespace(peft_config={"default": lora})
    with pytest.raises(lifecycle.ConfigError, match="target_parameters = \\['down_proj'\\]"):
        lifecycle.Switch.from_peft(model)


# PEFT's modules_to_save = ["lm_head"] and bias="lora_only": the head and the q / v biases (the
# adapted modules with a bias; down_proj has none) train beside the adapters
TRAINED_LORA = {**LORA, "modules_to_save": ["lm_head"], "bias": "lora_only"}
TRAINED = ["lm_head.weight"] + [
    f"model.layers.{l}.self_attn.{m}.bias" for l in range(2) for m in ("q_proj", "v_proj")
]


def test_trained_tensors_are_named_from_modules_to_save_and_bias():
    from lifecycle._lora import lora_args, trained_names

    names = [n for n, _ in lifecycle.expected_parameters(CONFIG, lora=LORA)]
    assert lora_args(TRAINED_LORA, names)[4] == sorted(TRAINED)
    # expected_parameters: the same names (the trained tensors are the model's own)
    assert lifecycle.expected_parameters(CONFIG, lora=TRAINED_LORA) == (
        lifecycle.expected_parameters(CONFIG, lora=LORA)
    )
    every_bias = [n for n in names if n.endswith(".bias")]
    assert len(every_bias) == 6  # q, k, v of 2 layers
    assert trained_names(names, [], "all") == sorted(every_bias)
    assert trained_names(names, ["embed_tokens", "norm"], "none") == [
        "model.embed_tokens.weight", "model.norm.weight"
    ]
    # a PEFT LoraConfig (attributes) reads as the dict does
    peft = SimpleNamespace(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                           modules_to_save=["lm_head"], bias="lora_only")
    assert lora_args(peft, names) == lora_args(TRAINED_LORA, names)
    with pytest.raises(lifecycle.ConfigError, match="modules_to_save: `score` names no module"):
        lora_args({**LORA, "modules_to_save": ["score"]}, names)
    with pytest.raises(lifecycle.ConfigError, match="bias: expected .*found 'some'"):
        lora_args({**LORA, "bias": "some"}, names)
    with pytest.raises(lifecycle.ConfigError, match="modules_to_save: expected module names"):
        lora_args({**LORA, "modules_to_save": "lm_head"}, names)


def test_a_refresh_moves_the_trained_whole_tensors_with_the_adapters_and_nothing_else():
    a = arrays()
    s = lifecycle.Switch.from_arrays(CONFIG, a, lora=TRAINED_LORA, world=2, rollout_tp=2)
    with s.rollout() as w:
        before = [{n: x.copy() for n, x in w.named_arrays(rank=r)} for r in range(2)]
    q = "model.layers.0.self_attn.q_proj"
    written = ["lm_head.weight", f"{q}.bias", "model.layers.1.self_attn.v_proj.bias",
               f"{q}.lora_B.weight"]
    with s.update() as m:
        for n in written:
            m[n] += 1.0
    with s.rollout() as w:
        after = [{n: x.copy() for n, x in w.named_arrays(rank=r)} for r in range(2)]
    assert s.stats()["refreshes"] == 1
    for r in range(2):
        changed = sorted(n for n in before[r] if not np.array_equal(before[r][n], after[r][n]))
        assert changed == sorted(written)
        # the head split on its rows (vocabulary) at T = 2, as its bf16
        assert np.array_equal(after[r]["lm_head.weight"], bf16_bits(a["lm_head.weight"][32 * r : 32 * r + 32]))
        assert np.array_equal(after[r][f"{q}.bias"], bf16_bits(a[f"{q}.bias"][8 * r : 8 * r + 8]))
    # a frozen bias (k_proj is not adapted: lora_only leaves it frozen) is still refused by name
    with s.update() as m:
        m["model.layers.0.self_attn.k_proj.bias"] += 1.0
    with pytest.raises(lifecycle.LifecycleError, match=r"`model\.layers\.0\.self_attn\.k_proj\.bias`.*frozen"):
        with s.rollout():
            pass


def test_bias_all_trains_every_bias_and_the_rest_stays_frozen():
    s = lifecycle.Switch.from_arrays(CONFIG, arrays(), lora={**LORA, "bias": "all"})
    with s.rollout():
        pass
    k = "model.layers.1.self_attn.k_proj.bias"
    with s.update() as m:
        m[k] -= 0.5
    with s.rollout() as w:
        got = dict(w.named_arrays())[k]
        assert np.array_equal(got, bf16_bits(s.masters[k]))
        del got
    assert s.stats()["refreshes"] == 1
    with s.update() as m:
        m["lm_head.weight"] += 1.0
    with pytest.raises(lifecycle.LifecycleError, match=r"`lm_head\.weight`.*frozen"):
        with s.rollout():
            pass


def test_peft_format_yields_the_trained_whole_tensors_under_peft_keys():
    s = lifecycle.Switch.from_arrays(CONFIG, arrays(), lora=TRAINED_LORA)
    with s.rollout() as w:
        peft = dict(w.named_arrays("peft"))
        hf = dict(w.named_arrays())
        adapters = {"base_model.model." + n for n in hf if ".lora_" in n}
        # what PEFT's saved adapter holds: the head under the model's name, an adapted
        # module's bias under its base_layer
        whole = {"base_model.model.lm_head.weight"} | {
            f"base_model.model.model.layers.{l}.self_attn.{m}.base_layer.bias"
            for l in range(2) for m in ("q_proj", "v_proj")
        }
        assert set(peft) == adapters | whole
        assert np.array_equal(peft["base_model.model.lm_head.weight"], hf["lm_head.weight"])
        b = "model.layers.1.self_attn.v_proj"
        assert np.array_equal(peft[f"base_model.model.{b}.base_layer.bias"], hf[f"{b}.bias"])
        del peft, hf
    # bias="all": a bias of a module without an adapter keeps its own name
    s = lifecycle.Switch.from_arrays(CONFIG, arrays(), lora={**LORA, "bias": "all"})
    with s.rollout() as w:
        keys = {n for n, _ in w.named_arrays("peft")}
    assert "base_model.model.model.layers.0.self_attn.k_proj.bias" in keys
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias" in keys


def test_bad_trained_names_are_refused_by_name():
    a = arrays()
    with pytest.raises(lifecycle.ConfigError, match="modules_to_save: `classifier`"):
        lifecycle.Switch.from_arrays(CONFIG, a, lora={**LORA, "modules_to_save": ["classifier"]})
    with pytest.raises(lifecycle.ConfigError, match="bias: expected"):
        lifecycle.Switch.from_arrays(CONFIG, a, lora={**LORA, "bias": True})


def test_from_peft_takes_modules_to_save_and_trainable_biases():
    """modules_to_save and bias="all" / "lora_only" pass from_peft's checks (the module is read
    next: this fake has no config, which is the next thing refused); PEFT's lora_bias (a bias
    on lora_B) is refused by name."""
    def model(**fields):
        base = dict(r=4, lora_alpha=8, target_modules={"q_proj"}, use_rslora=False,
                    modules_to_save=None, bias="none")
        return SimpleNamespace(peft_config={"default": SimpleNamespace(**{**base, **fields})})

    for fields in ({"modules_to_save": ["lm_head"]}, {"bias": "lora_only"}, {"bias": "all"}):
        m = model(**fields)
        with pytest.raises(lifecycle.ConfigError, match="has no `config`"):
            lifecycle.Switch.from_peft(m)
    m = model(lora_bias=True)
    with pytest.raises(lifecycle.ConfigError, match="lora_bias = True"):
        lifecycle.Switch.from_peft(m)


def test_a_shared_base_is_checked_by_name_before_anything_is_read():
    """The extension's shared base (a LoRA model's frozen bf16 tensors read in place, which
    ``from_peft`` sets apart on the GPU): refused by name on the host backend, for an adapter,
    and without LoRA adapters; nothing is read (the addresses are never dereferenced)."""
    import json

    from lifecycle import _lifecycle
    from lifecycle._lora import lora_args

    names = lifecycle.expected_parameters(CONFIG, lora=LORA)
    largs = lora_args(LORA, [n for n, _ in names])

    def make(shared, lora=largs, device="cpu", listed=names):
        kept = [(n, s) for n, s in listed if n not in {x[0] for x in shared}]
        return _lifecycle._Switch(
            json.dumps(CONFIG), kept, world=1, tp=1, dtype_name="bf16", experts_name="tp",
            offload="none", switching="lazy", device=device, lora=lora, shared=shared,
        )

    q = ("model.layers.0.self_attn.q_proj.weight", [16, 16], 0x1000)
    with pytest.raises(lifecycle.TensorMismatchError, match=r"`model\.layers\.0\.self_attn\.q_proj\.weight`.*cuda"):
        make([q])
    a = ("model.layers.0.self_attn.q_proj.lora_A.weight", [2, 16], 0x1000)
    with pytest.raises(lifecycle.TensorMismatchError, match=r"lora_A\.weight`.*adapter"):
        make([a])
    plain = lifecycle.expected_parameters(CONFIG)
    with pytest.raises(lifecycle.TensorMismatchError, match=r"q_proj\.weight`.*LoRA"):
        make([q], lora=None, listed=plain)
