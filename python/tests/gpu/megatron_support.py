"""Megatron-Core models for the GPU tests (pytest's and the torchrun scripts'): a ``GPTModel``
with the local spec, dense (Qwen2 / Qwen3 shaped) or mixture-of-experts (Qwen3-MoE shaped),
in ``Float16Module`` and ``DistributedDataParallel`` with the distributed optimizer, as
Megatron's ``get_model`` and ``get_megatron_optimizer`` make them; its Hugging Face config;
the fused rollout tensors expected from the whole model's parameters; and the Hugging Face
checkpoint of a rollout (what ``transformers`` loads)."""

from __future__ import annotations

import torch

VOCAB, PADDED = 1000, 1024
H, HEADS, GROUPS, D, FFN, LAYERS = 256, 4, 2, 64, 512, 2
EXPERTS, TOPK, MOE_FFN = 8, 2, 128


def hf_config(qk_norm: bool = False, moe: bool = False, layers: int = LAYERS) -> dict:
    """The Hugging Face config of the model :func:`megatron_model` builds."""
    kind = "qwen3_moe" if moe else "qwen3" if qk_norm else "qwen2"
    cfg = {
        "model_type": kind,
        "architectures": [
            {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
                kind, "Qwen3MoeForCausalLM"
            )
        ],
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": D,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }
    if qk_norm or moe:
        cfg["attention_bias"] = False
    if moe:
        cfg.update(
            num_experts=EXPERTS,
            num_experts_per_tok=TOPK,
            moe_intermediate_size=MOE_FFN,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
    return cfg


def megatron_model(
    qk_norm: bool = False,
    moe: bool = False,
    overlap_param_gather: bool = False,
    layers: int = LAYERS,
    optimizer: bool = True,
):
    """``(model, gpt, optimizer)`` on this process's rank of the model parallel state (TP =
    PP = DP = 1 made where none is), norms drawn away from 1 so that a misplaced norm shows."""
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
    qk_norm = qk_norm or moe
    experts = (
        dict(
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_ffn_hidden_size=MOE_FFN,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall",
        )
        if moe
        else {}
    )
    config = TransformerConfig(
        num_layers=layers,
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
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        # Megatron-Core asks for sequence parallelism where experts and TP both split
        sequence_parallel=moe
        and ps.get_tensor_model_parallel_world_size() > 1
        and ps.get_expert_model_parallel_world_size() > 1,
        pipeline_dtype=torch.bfloat16,
        **experts,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=EXPERTS if moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=qk_norm,
        normalization="RMSNorm",
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=PADDED,
        max_sequence_length=512,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    ).cuda()
    with torch.no_grad():
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
    opt = None
    if optimizer:
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True),
            [model],
        )
    return model, gpt, opt


def _qkv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's ``linear_qkv`` (per query group ``[q of the group; k; v]``) as ``[q; k; v]``."""
    per = HEADS // GROUPS
    g = t.reshape(groups, (per + 2) * D, *t.shape[1:])
    q, k, v = g[:, : per * D], g[:, per * D : (per + 1) * D], g[:, (per + 1) * D :]
    return torch.cat([x.reshape(-1, *t.shape[1:]) for x in (q, k, v)])


def expected(p: dict, qk_norm: bool = False, moe: bool = False, layers: int = LAYERS) -> dict:
    """The fused rollout tensors (T = 1) of the whole model's Megatron parameters ``p`` (layout
    names, e.g. from :func:`whole`): ``linear_qkv`` regrouped into ``[q; k; v]``, ``linear_fc1``
    as ``[gate; up]``, experts stacked, the vocabulary unpadded."""
    qk_norm = qk_norm or moe
    out = {
        "model.embed_tokens.weight": p["embedding.word_embeddings.weight"][:VOCAB],
        "model.norm.weight": p["decoder.final_layernorm.weight"],
        "lm_head.weight": p["output_layer.weight"][:VOCAB],
    }
    for i in range(layers):
        a, m = f"decoder.layers.{i}.self_attention.", f"decoder.layers.{i}.mlp."
        o = f"model.layers.{i}."
        out[o + "input_layernorm.weight"] = p[f"decoder.layers.{i}.input_layernorm.weight"]
        out[o + "post_attention_layernorm.weight"] = p[f"decoder.layers.{i}.pre_mlp_layernorm.weight"]
        out[o + "self_attn.qkv_proj.weight"] = _qkv(p[a + "linear_qkv.weight"], GROUPS)
        if not qk_norm:
            out[o + "self_attn.qkv_proj.bias"] = _qkv(p[a + "linear_qkv.bias"], GROUPS)
        else:
            out[o + "self_attn.q_norm.weight"] = p[a + "q_layernorm.weight"]
            out[o + "self_attn.k_norm.weight"] = p[a + "k_layernorm.weight"]
        out[o + "self_attn.o_proj.weight"] = p[a + "linear_proj.weight"]
        if moe:
            out[o + "mlp.gate.weight"] = p[m + "router.weight"]
            out[o + "mlp.experts.w13_weight"] = torch.stack(
                [p[f"{m}experts.linear_fc1.weight{e}"] for e in range(EXPERTS)]
            )
            out[o + "mlp.experts.w2_weight"] = torch.stack(
                [p[f"{m}experts.linear_fc2.weight{e}"] for e in range(EXPERTS)]
            )
        else:
            out[o + "mlp.gate_up_proj.weight"] = p[m + "linear_fc1.weight"]
            out[o + "mlp.down_proj.weight"] = p[m + "linear_fc2.weight"]
    return out


def whole(ranks: list[tuple[tuple[int, int, int], dict]], tp: int) -> dict:
    """The whole model's Megatron parameters (layout names) from every rank's
    ``((tp rank, pp rank, dp rank), {name: tensor})``, joined the way Megatron-Core splits them
    over TP: the vocabulary, ``linear_qkv`` (whole query groups) and the experts' ``fc1`` rows
    in rank order (its bias too), ``linear_fc1`` as ``[gate of every rank; up of every rank]``
    (each rank holds ``[its gate; its up]``), ``linear_proj`` and ``fc2`` columns in rank
    order; the norms and the router replicated (checked equal)."""
    names = sorted({n for _, part in ranks for n in part})
    out = {}
    for n in names:
        parts = {}
        for (t, _pp, dp), part in ranks:
            if n in part and dp == 0:
                parts[t] = part[n]
        ordered = [parts[t] for t in range(tp)]
        first = ordered[0]
        replicated = first.ndim == 1 and not n.endswith("linear_qkv.bias")
        if tp == 1 or replicated or n.endswith("router.weight"):
            for other in ordered[1:]:
                assert torch.equal(other, first), f"{n}: replicated, yet the ranks differ"
            out[n] = first
        elif "linear_proj" in n or "linear_fc2" in n:
            out[n] = torch.cat(ordered, dim=1)
        elif "linear_fc1" in n:
            halves = [x.chunk(2) for x in ordered]
            out[n] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[n] = torch.cat(ordered)
    return out


def hf_checkpoint(named: dict, moe: bool = False) -> dict:
    """A T = 1 fused rollout (``named_tensors("hf")``) as a Hugging Face checkpoint: ``q`` /
    ``k`` / ``v`` and ``gate`` / ``up`` apart, each expert's matrices under its own name."""
    q_rows, kv_rows = HEADS * D, GROUPS * D
    out = {}
    for n, t in named.items():
        if "qkv_proj" in n:
            q, k, v = t.split([q_rows, kv_rows, kv_rows])
            for part, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[n.replace("qkv_proj", part)] = x
        elif n.endswith("mlp.gate_up_proj.weight"):
            gate, up = t.chunk(2)
            out[n.replace("gate_up_proj", "gate_proj")] = gate
            out[n.replace("gate_up_proj", "up_proj")] = up
        elif n.endswith("experts.w13_weight"):
            base = n[: -len("w13_weight")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{base}{e}.gate_proj.weight"] = gate
                out[f"{base}{e}.up_proj.weight"] = up
        elif n.endswith("experts.w2_weight"):
            base = n[: -len("w2_weight")]
            for e, w in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = w
        else:
            out[n] = t
    assert moe == any("experts" in n for n in out)
    return {n: t.contiguous().clone() for n, t in out.items()}
