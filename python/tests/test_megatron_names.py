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
