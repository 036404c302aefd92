"""vLLM's runtime parameter names and rank-local shapes (what its weight-transfer API copies
by name with ``is_checkpoint_format=False``), and the rollout tensors fused into them.

The rules, read from vLLM's model source (``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``,
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``VocabParallelEmbedding``,
``FusedMoE``; ``tests/fixtures/vllm_runtime_names.md`` cites them): per layer ``qkv_proj``
(``[q heads of the rank; its kv heads' k; their v]``, a kv head replicated on ``T / kv`` ranks
when there are fewer kv heads than ranks), its bias (Qwen2), ``o_proj``, the q/k norms (Qwen3),
the MLP (``gate_up_proj`` and ``down_proj``, or the router ``gate`` and the experts'
``w13_weight`` / ``w2_weight``), then the two norms; the vocabulary padded to a multiple of 64
and split evenly; a tied head not listed.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

VOCAB_PADDING = 64


def _config(config: Any) -> dict:
    if isinstance(config, str):
        return json.loads(config)
    if isinstance(config, dict):
        return config
    return json.loads(config.to_json_string())


def _model_type(c: dict) -> str:
    if "model_type" in c:
        return c["model_type"]
    arch = (c.get("architectures") or [c.get("architecture", "")])[0]
    return {
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
    }.get(arch, "")


class _Shape:
    """The rank-local geometry vLLM gives a config at degree ``tp``."""

    def __init__(self, c: dict, tp: int, ep: bool):
        from ._lifecycle import ConfigError

        self.kind = _model_type(c)
        if self.kind not in ("qwen2", "qwen3", "qwen3_moe"):
            raise ConfigError(f"vLLM names: model_type `{self.kind}` is not Qwen2/Qwen3/Qwen3-MoE")
        self.h = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.kv = c.get("num_key_value_heads", self.heads)
        # Qwen2 derives head_dim from hidden / heads; Qwen3 reads it
        self.hd = (
            self.h // self.heads if self.kind == "qwen2" else c.get("head_dim", self.h // self.heads)
        )
        if self.heads % tp:
            raise ConfigError(f"vLLM names: num_attention_heads {self.heads} not divisible by T={tp}")
        if self.kv >= tp and self.kv % tp or self.kv < tp and tp % self.kv:
            raise ConfigError(f"vLLM names: num_key_value_heads {self.kv} and T={tp} do not divide")
        self.tp, self.ep = tp, ep
        self.q_local = self.heads // tp
        self.kv_local = max(1, self.kv // tp)
        self.bias = self.kind == "qwen2" or bool(c.get("attention_bias", False))
        self.qk_norm = self.kind != "qwen2"
        self.ffn = c["intermediate_size"]
        self.vocab = c["vocab_size"]
        self.padded = -(-self.vocab // VOCAB_PADDING) * VOCAB_PADDING
        if self.padded % tp:
            raise ConfigError(f"vLLM names: padded vocabulary {self.padded} not divisible by T={tp}")
        self.vocab_local = self.padded // tp
        self.tied = bool(c.get("tie_word_embeddings", False))
        self.layers = c["num_hidden_layers"]
        self.experts = c.get("num_experts", 0) if self.kind == "qwen3_moe" else 0
        self.moe_ffn = c.get("moe_intermediate_size", 0)
        self.sparse_step = c.get("decoder_sparse_step", 1)
        self.dense_layers = set(c.get("mlp_only_layers", []) or [])

    def moe_layer(self, i: int) -> bool:
        return (
            self.experts > 0
            and i not in self.dense_layers
            and self.sparse_step > 0
            and (i + 1) % self.sparse_step == 0
        )

    def kv_head(self, rank: int) -> range:
        """The kv heads rank ``rank`` holds."""
        if self.kv >= self.tp:
            return range(rank * self.kv_local, (rank + 1) * self.kv_local)
        g = rank // (self.tp // self.kv)
        return range(g, g + 1)


def vllm_names(config: Any, tp: int = 1, *, experts: str = "tp") -> list[tuple[str, list[int]]]:
    """vLLM's runtime parameters of ``config`` (a Hugging Face config, dict or JSON) on one
    rank at tensor-parallel degree ``tp``, in ``named_parameters()`` order: ``(name, shape)``.
    ``experts="ep"`` places whole experts on the ranks (``enable_expert_parallel``)."""
    s = _Shape(_config(config), tp, experts == "ep")
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [s.vocab_local, s.h])]
    qkv = (s.q_local + 2 * s.kv_local) * s.hd
    for i in range(s.layers):
        p = f"model.layers.{i}."
        out.append((p + "self_attn.qkv_proj.weight", [qkv, s.h]))
        if s.bias:
            out.append((p + "self_attn.qkv_proj.bias", [qkv]))
        out.append((p + "self_attn.o_proj.weight", [s.h, s.q_local * s.hd]))
        if s.qk_norm:
            out.append((p + "self_attn.q_norm.weight", [s.hd]))
            out.append((p + "self_attn.k_norm.weight", [s.hd]))
        if s.moe_layer(i):
            e_local, f_local = (s.experts // tp, s.moe_ffn) if s.ep else (s.experts, s.moe_ffn // tp)
            out.append((p + "mlp.gate.weight", [s.experts, s.h]))
            out.append((p + "mlp.experts.w13_weight", [e_local, 2 * f_local, s.h]))
            out.append((p + "mlp.experts.w2_weight", [e_local, s.h, f_local]))
        else:
            out.append((p + "mlp.gate_up_proj.weight", [2 * s.ffn // tp, s.h]))
            out.append((p + "mlp.down_proj.weight", [s.h, s.ffn // tp]))
        out.append((p + "input_layernorm.weight", [s.h]))
        out.append((p + "post_attention_layernorm.weight", [s.h]))
    out.append(("model.norm.weight", [s.h]))
    if not s.tied:
        out.append(("lm_head.weight", [s.vocab_local, s.h]))
    return out


def _is_torch(t) -> bool:
    return type(t).__module__.startswith("torch")


def _cat(parts):
    if _is_torch(parts[0]):
        import torch

        return torch.cat(parts)
    import numpy as np

    return np.concatenate(parts)


def _stack(parts):
    if _is_torch(parts[0]):
        import torch

        return torch.stack(parts)
    import numpy as np

    return np.stack(parts)


def _zero_rows(t, rows: int):
    if _is_torch(t):
        return t.new_zeros((rows, *t.shape[1:]))
    import numpy as np

    return np.zeros((rows, *t.shape[1:]), dtype=t.dtype)


def _vocab_shard(name: str, t, s: _Shape, rank: int):
    """vLLM's padded vocabulary rows of ``rank`` from this rank's rollout slice ``t``."""
    from ._lifecycle import ConfigError

    lo, hi = rank * s.vocab_local, (rank + 1) * s.vocab_local
    held = t.shape[0]
    if held == s.vocab:  # replicated: every row is here
        first = 0
    elif held * s.tp == s.vocab:  # split evenly, unpadded
        first = rank * held
    else:
        raise ConfigError(f"{name}: a rollout slice of {held} rows is not a vocabulary shard")
    need_lo, need_hi = lo, min(hi, s.vocab)
    if need_lo < need_hi and not (first <= need_lo and need_hi <= first + held):
        raise ConfigError(
            f"{name}: vLLM's rank {rank} holds vocabulary rows {lo}..{hi} (padded to "
            f"{s.padded}), this rank's rollout slice holds rows {first}..{first + held}"
        )
    rows = t[max(need_lo - first, 0) : max(need_hi - first, 0)]
    pad = s.vocab_local - rows.shape[0]
    if pad == 0:
        return rows
    return _cat([rows, _zero_rows(rows, pad)])


def vllm_tensors(config: Any, hf: dict, tp: int, rank: int) -> Iterator[tuple[str, Any]]:
    """The rollout tensors of one rank (``hf``: rollout names → torch tensors or numpy arrays)
    as vLLM's runtime parameters: fused ones concatenated (new tensors), the others as they
    are."""
    from ._lifecycle import ConfigError

    c = _config(config)
    experts = "tp"
    if any(".mlp.experts." in n for n in hf):
        layer0 = next(n for n in hf if ".mlp.experts." in n)
        stem = layer0.split(".mlp.experts.")[0]
        held = sorted(
            {
                int(n[len(stem) + len(".mlp.experts.") :].split(".")[0])
                for n in hf
                if n.startswith(stem + ".mlp.experts.")
            }
        )
        experts = "ep" if tp > 1 and len(held) * tp == c.get("num_experts", 0) else "tp"
    s = _Shape(c, tp, experts == "ep")
    for name, shape in vllm_names(c, tp, experts=experts):
        p, _, suffix = name.rpartition("mlp.") if ".mlp." in name else name.rpartition("self_attn.")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = _vocab_shard(name, hf[name], s, rank)
        elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            kind = "weight" if name.endswith("weight") else "bias"
            parts = [hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"]
            q, k, v = parts
            if k.shape[0] != s.kv_local * s.hd:  # kv heads replicated: keep this rank's
                heads = s.kv_head(rank)
                k = k[heads.start * s.hd : heads.stop * s.hd]
                v = v[heads.start * s.hd : heads.stop * s.hd]
            t = _cat([q, k, v])
        elif name.endswith("gate_up_proj.weight"):
            t = _cat([hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]])
        elif name.endswith("experts.w13_weight") or name.endswith("experts.w2_weight"):
            ids = sorted(
                {
                    int(n[len(p) + len("mlp.experts.") :].split(".")[0])
                    for n in hf
                    if n.startswith(p + "mlp.experts.")
                }
            )
            if name.endswith("w13_weight"):
                per = [
                    _cat(
                        [hf[f"{p}mlp.experts.{e}.gate_proj.weight"], hf[f"{p}mlp.experts.{e}.up_proj.weight"]]
                    )
                    for e in ids
                ]
            else:
                per = [hf[f"{p}mlp.experts.{e}.down_proj.weight"] for e in ids]
            t = _stack(per)
        else:
            t = hf[name]
        if list(t.shape) != shape:
            raise ConfigError(f"{name}: built shape {list(t.shape)}, vLLM's is {shape}")
        yield name, t
