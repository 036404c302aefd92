"""Megatron-Core's parameter names as the switch's Megatron layout names them (no torch or
megatron-core needed: the GPU test `gpu/test_megatron.py` runs the real model)."""

from lifecycle._megatron import layout_name


def test_wrappers_and_specs_name_their_parameters_as_the_layout_does():
    cases = {
        # DistributedDataParallel(Float16Module(GPTModel)) prefixes
        "module.module.decoder.layers.0.self_attention.linear_qkv.weight": (
            "decoder.layers.0.self_attention.linear_qkv.weight"
        ),
        "module.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
        "output_layer.weight": "output_layer.weight",
        # Transformer Engine's spec: the norms fused into the linear layers after them
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": (
            "decoder.layers.3.input_layernorm.weight"
        ),
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": (
            "decoder.layers.3.pre_mlp_layernorm.weight"
        ),
        # SequentialMLP's expert modules; the layout numbers the weights as TEGroupedMLP does
        "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight": (
            "decoder.layers.1.mlp.experts.linear_fc2.weight7"
        ),
        "decoder.layers.1.mlp.router.weight": "decoder.layers.1.mlp.router.weight",
    }
    for name, want in cases.items():
        assert layout_name(name) == want, name


def test_a_pipeline_stage_names_its_layers_as_the_whole_model_does():
    """Megatron-Core's stage 1 of 2 (14 layers each) numbers its modules from 0; the layout (and
    ``megatron_parameters(..., pp=2, rank=1)``) from 14. Non-layer names stay as they are."""
    import json

    import lifecycle

    cfg = json.dumps(
        {
            "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e4, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "max_position_embeddings": 64,
        }
    )
    stage = [n for n, _ in lifecycle.megatron_parameters(cfg, pp=2, rank=1)]
    local = [n.replace("layers.2.", "layers.0.").replace("layers.3.", "layers.1.") for n in stage]
    assert [layout_name(n, first_layer=2) for n in local] == stage
    assert layout_name("module.decoder.layers.0.mlp.linear_fc1.weight", 14) == (
        "decoder.layers.14.mlp.linear_fc1.weight"
    )
    assert layout_name("decoder.final_layernorm.weight", 14) == "decoder.final_layernorm.weight"


def test_from_megatron_without_megatron_core_says_what_to_install():
    import importlib.util
    import warnings

    import pytest

    import lifecycle

    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron-core is installed here: the GPU tests cover from_megatron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(lifecycle.ConfigError, match="needs megatron-core installed"):
            lifecycle.Switch.from_megatron(object(), None, {"model_type": "qwen2"})


def _spec_names(spec: dict, config: dict) -> list[str]:
    """Every parameter name a GPTModel of ``config`` registers under ``spec`` (the fixture's
    templates), wrapped as DDP(Float16Module(model)) names them."""
    moe = "num_experts" in config
    names = list(spec["model"])
    for layer in range(config["num_hidden_layers"]):
        parts = list(spec["attention"])
        if config["model_type"] == "qwen2":
            parts += spec["qkv_bias"]
        else:
            parts += spec["qk_norm"]
        if moe:
            parts += spec["moe_mlp"]
            for i in range(config["num_experts"]):
                parts += [e.replace("{i}", str(i)) for e in spec["expert"]]
        else:
            parts += spec["dense_mlp"]
        names += [f"decoder.layers.{layer}.{p}" for p in parts]
    return ["module.module." + n for n in names]


def test_every_spec_names_its_parameters_as_the_megatron_layout_does():
    """The names of Megatron-Core's local and Transformer Engine specs (read from its source:
    tests/fixtures/megatron_spec_names.json) map one to one onto the Megatron layout's, for a
    Qwen2 (q/k/v biases), a Qwen3 (q/k norms) and a Qwen3-MoE model."""
    import json
    from pathlib import Path

    import lifecycle

    fixture = json.loads((Path(__file__).parent / "fixtures" / "megatron_spec_names.json").read_text())
    base = {
        "vocab_size": 100,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "intermediate_size": 32,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    configs = [
        {**base, "model_type": "qwen2"},
        {**base, "model_type": "qwen3"},
        {
            **base,
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
        },
    ]
    for config in configs:
        want = [n for n, _ in lifecycle.megatron_parameters(config)]
        for spec_name, spec in fixture["specs"].items():
            got = [layout_name(n) for n in _spec_names(spec, config)]
            assert sorted(got) == sorted(want), (config["model_type"], spec_name)
            assert len(set(got)) == len(got), (config["model_type"], spec_name)


def test_expert_parallel_ranks_hold_their_share_of_the_experts():
    """At EP = 2 each rank registers half the experts, numbered from 0 (``local_experts.{j}``);
    ETP = 1 keeps an expert's rows whole beside TP = 2; a dense model refuses EP > 1 by name."""
    import pytest

    import lifecycle

    config = {
        "model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 32, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
    }

    def experts(**degrees):
        return {
            n: s for n, s in lifecycle.megatron_parameters(config, **degrees) if ".experts." in n
        }

    whole = experts()
    assert len(whole) == 2 * 2 * 4
    for rank in (0, 1):
        half = experts(dp=2, ep=2, rank=rank)
        assert sorted(half) == sorted(n for n in whole if n[-1] in "01"), rank
        assert all(half[n] == whole[n] for n in half)
    tp2 = experts(tp=2, etp=1, rank=1)
    assert tp2 == whole
    split = experts(tp=2, rank=1)  # ETP = TP: each expert's intermediate rows halved
    assert split["decoder.layers.0.mlp.experts.linear_fc1.weight0"] == [8, 16]
    with pytest.raises(lifecycle.ConfigError, match="experts"):
        lifecycle.megatron_parameters({**config, "num_experts": 3}, dp=2, ep=2)
    dense = {k: v for k, v in config.items() if "expert" not in k and k != "model_type"}
    with pytest.raises(lifecycle.ConfigError, match="EP = 2 needs a mixture-of-experts model"):
        lifecycle.megatron_parameters({**dense, "model_type": "qwen3"}, dp=2, ep=2)
