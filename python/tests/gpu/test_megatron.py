"""The bridge over a real Megatron-Core model on the GPU (TP = PP = DP = 1): a ``GPTModel``
built with the local spec, in ``Float16Module`` and ``DistributedDataParallel`` with the
distributed optimizer, as Megatron's ``get_model`` and ``get_megatron_optimizer`` make them.
Skipped where ``megatron-core`` is not installed (the device installs its wheel)."""

import pytest
import torch

core = pytest.importorskip("megatron.core")

import lifecycle  # noqa: E402

VOCAB, PADDED = 1000, 1024
H, HEADS, GROUPS, D, FFN, LAYERS = 256, 4, 2, 64, 512, 2


def hf_config(qk_norm: bool) -> dict:
    return {
        "model_type": "qwen3" if qk_norm else "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": D,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        **({"attention_bias": False} if qk_norm else {}),
    }


def megatron_model(qk_norm: bool = False, overlap_param_gather: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=D,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=not qk_norm,
        qk_layernorm=qk_norm,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=PADDED,
        max_sequence_length=512,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    ).cuda()
    with torch.no_grad():
        # norms away from 1, so that a misplaced norm shows
        for n, p in gpt.named_parameters():
            if "layernorm" in n:
                p.uniform_(0.5, 1.5)
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            grad_reduce_in_fp32=True,
            overlap_param_gather=overlap_param_gather,
        ),
        Float16Module(config, gpt),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True),
        [model],
    )
    return model, gpt, opt


def expected(gpt, qk_norm: bool) -> dict:
    """The fused rollout tensors from Megatron's own parameters: ``linear_qkv``'s groups
    ``[q of the group; k; v]`` regrouped into ``[q; k; v]``, ``linear_fc1`` as ``[gate; up]``,
    the vocabulary unpadded."""
    p = {n: t.detach() for n, t in gpt.named_parameters()}
    per = HEADS // GROUPS

    def qkv(t):
        g = t.reshape(GROUPS, (per + 2) * D, *t.shape[1:])
        q, k, v = g[:, : per * D], g[:, per * D : (per + 1) * D], g[:, (per + 1) * D :]
        return torch.cat([x.reshape(-1, *t.shape[1:]) for x in (q, k, v)])

    out = {
        "model.embed_tokens.weight": p["embedding.word_embeddings.weight"][:VOCAB],
        "model.norm.weight": p["decoder.final_layernorm.weight"],
        "lm_head.weight": p["output_layer.weight"][:VOCAB],
    }
    for i in range(LAYERS):
        a, m = f"decoder.layers.{i}.self_attention.", f"decoder.layers.{i}.mlp."
        o = f"model.layers.{i}."
        out[o + "input_layernorm.weight"] = p[f"decoder.layers.{i}.input_layernorm.weight"]
        out[o + "post_attention_layernorm.weight"] = p[f"decoder.layers.{i}.pre_mlp_layernorm.weight"]
        out[o + "self_attn.qkv_proj.weight"] = qkv(p[a + "linear_qkv.weight"])
        if not qk_norm:
            out[o + "self_attn.qkv_proj.bias"] = qkv(p[a + "linear_qkv.bias"])
        else:
            out[o + "self_attn.q_norm.weight"] = p[a + "q_layernorm.weight"]
            out[o + "self_attn.k_norm.weight"] = p[a + "k_layernorm.weight"]
        out[o + "self_attn.o_proj.weight"] = p[a + "linear_proj.weight"]
        out[o + "mlp.gate_up_proj.weight"] = p[m + "linear_fc1.weight"]
        out[o + "mlp.down_proj.weight"] = p[m + "linear_fc2.weight"]
    return out


def same(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for n, t in got.items():
        assert t.dtype == torch.bfloat16 and t.is_cuda, n
        assert torch.equal(t.view(torch.int16), want[n].view(torch.int16)), n


def step(model, gpt, opt):
    """One forward, backward and optimizer step of Megatron's own."""
    ids = torch.randint(0, VOCAB, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(2, -1)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    model.finish_grad_sync()
    opt.step()
    opt.zero_grad()
    model.zero_grad_buffer()


@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
def test_from_megatron_reads_the_parameters_in_place_into_the_fused_layout(qk_norm):
    model, gpt, opt = megatron_model(qk_norm)
    # the parameters live in DDP's bf16 buffer, in reverse order: the switch reads them there
    buf = model.buffers[0].param_data
    inside = [
        buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() * 2
        for p in gpt.parameters()
    ]
    assert all(inside), "every parameter a view into param_data"
    switch = lifecycle.Switch.from_megatron(model, opt, hf_config(qk_norm))
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        same(got, expected(gpt, qk_norm))
        del got
    print(f"from_megatron {'qwen3' if qk_norm else 'qwen2'}: {len(switch._sources)} parameters "
          "read in place, the fused rollout bit-identical to Megatron's regrouped parameters")


def test_an_optimizer_step_the_switch_never_saw_marks_the_weights_stale():
    model, gpt, opt = megatron_model()
    switch = lifecycle.Switch.from_megatron(model, opt, hf_config(False))
    for _ in range(3):
        with switch.rollout():
            pass
    assert switch.stats()["generation"] == 1
    before = [p._version for p in gpt.parameters()]
    switch.train()
    step(model, gpt, opt)
    # the distributed optimizer writes through .data: no parameter's counter moved, so a
    # switch that read them alone would reuse the old weights
    assert [p._version for p in gpt.parameters()] == before
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        same(got, expected(gpt, False))
        del got
    assert switch.stats()["generation"] == 2
    print("an unseen Megatron optimizer step: the next rollout refreshed (generation 2), "
          "the parameters' own counters unmoved")


def test_megatron_models_the_switch_cannot_read_are_refused_by_name():
    model, gpt, opt = megatron_model(overlap_param_gather=True)
    with pytest.raises(lifecycle.ConfigError, match="overlap_param_gather"):
        lifecycle.Switch.from_megatron(model, opt, hf_config(False))
    model, gpt, opt = megatron_model()
    wrong = {**hf_config(False), "intermediate_size": FFN * 2}
    with pytest.raises(lifecycle.TensorMismatchError, match="linear_fc1"):
        lifecycle.Switch.from_megatron(model, opt, wrong)


def test_our_engine_on_megatron_weights_agrees_with_megatrons_forward():
    """Teacher-forced consumer check: greedy tokens of our engine on the switched weights equal
    the argmax of Megatron-Core's own forward over the same tokens, except where its top two
    logits are closer than 0.05."""
    model, gpt, opt = megatron_model()
    step(model, gpt, opt)
    switch = lifecycle.Switch.from_megatron(model, opt, hf_config(False))
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=96)
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (16,))] for _ in range(4)]
    with switch.rollout() as w:
        samples = engine.generate(w, prompts, max_new_tokens=24)
    switch.train()
    checked = close = 0
    with torch.no_grad():
        for p, s in zip(prompts, samples):
            seq = torch.tensor([p + s.tokens], device="cuda")
            pos = torch.arange(seq.shape[1], device="cuda").unsqueeze(0)
            logits = model(seq, pos, None).float()[0, :, :VOCAB]
            for j, tok in enumerate(s.tokens):
                row = logits[len(p) - 1 + j]
                top = torch.topk(row, 2)
                if float(top.values[0] - top.values[1]) < 0.05:
                    close += 1
                    continue
                assert int(top.indices[0]) == tok, (j, int(top.indices[0]), tok)
                checked += 1
    assert checked > 0
    print(f"engine vs Megatron-Core forward: {checked} greedy tokens equal, {close} near-ties "
          "skipped")
