"""vLLM's runtime parameter names and rank-local shapes (what its weight-transfer API copies
by name with ``is_checkpoint_format=False``; computed by the Rust library,
``lifecycle_layout::vllm``), and the rollout tensors fused into them.

The rules, read from vLLM's model source (``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``,
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``VocabParallelEmbedding``,
``FusedMoE``; ``tests/fixtures/vllm_runtime_names.md`` cites them): per layer ``qkv_proj``
(``[q heads of the rank; its kv heads' k; their v]``, a kv head replicated on ``T / kv`` ranks
when there are fewer kv heads than ranks), its bias (Qwen2), ``o_proj``, the q/k norms (Qwen3),
the MLP (``gate_up_proj`` and ``down_proj``, or the router ``gate`` and the experts'
``w13_weight`` / ``w2_weight``), then the two norms; the vocabulary padded to a multiple of 64
and split evenly; a tied head not listed.

fp8 rollouts come as vLLM's block-fp8 parameters (``Fp8Config``, ``weight_block_size`` [128,
128], float32 scales as on Hopper): each quantised matrix's ``weight`` (e4m3), then its
``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]`` (before a bias); FusedMoE's ``w13_weight``
and ``w2_weight``, then their scales. The router ``mlp.gate`` stays bf16, as the rollout keeps it
(Qwen's fp8 checkpoints list it in ``ignored_layers``). A fused tensor is its parts' bytes and
scales stacked, exact where every part but the last fills whole 128-row blocks (then vLLM's
block grid over the fused rows is the parts' grids); a part that does not is refused by name.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Literal

VOCAB_PADDING = 64
# rows and columns of one fp8 scale block
BLOCK = 128


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
    """The rank-local geometry vLLM gives a config at degree ``tp`` (which ``vllm_names``, in
    Rust, has checked), for slicing the rollout's tensors into vLLM's."""

    def __init__(self, c: dict, tp: int):
        self.kind = _model_type(c)
        self.h = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.kv = c.get("num_key_value_heads", self.heads)
        # Qwen2 derives head_dim from hidden / heads; Qwen3 reads it
        self.hd = (
            self.h // self.heads if self.kind == "qwen2" else c.get("head_dim", self.h // self.heads)
        )
        self.tp = tp
        self.kv_local = max(1, self.kv // tp)
        self.vocab = c["vocab_size"]
        self.padded = -(-self.vocab // VOCAB_PADDING) * VOCAB_PADDING
        self.vocab_local = self.padded // tp

    def kv_head(self, rank: int) -> range:
        """The kv heads rank ``rank`` holds."""
        if self.kv >= self.tp:
            return range(rank * self.kv_local, (rank + 1) * self.kv_local)
        g = rank // (self.tp // self.kv)
        return range(g, g + 1)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def vllm_names(
    config: Any,
    tp: int = 1,
    *,
    experts: Literal["tp", "ep"] = "tp",
    dtype: Literal["bf16", "fp8"] = "bf16",
) -> list[tuple[str, list[int]]]:
    """vLLM's runtime parameters of ``config`` (a Hugging Face config, dict or JSON) on one
    rank at tensor-parallel degree ``tp``, in ``named_parameters()`` order: ``(name, shape)``.
    ``experts="ep"`` places whole experts on the ranks (``enable_expert_parallel``).
    ``dtype="fp8"``: vLLM's block-fp8 parameters (the module's docs), raising
    :class:`ConfigError` where vLLM's block checks refuse the degree (a row-parallel input or an
    expert's width per rank that is not a multiple of 128). Computed by the Rust library
    (``lifecycle_layout::vllm``), as the rollout's own layouts are."""
    from ._lifecycle import vllm_names as names

    c = dict(_config(config))
    if "rope_theta" not in c and "rope_parameters" not in c:
        # the rotary base shapes no parameter: a geometry-only config takes transformers' default
        c["rope_theta"] = 10000.0
    return [(n, list(shape)) for n, shape in names(json.dumps(c), tp, experts, dtype)]


def _scale_name(weight: str) -> str:
    return weight[: -len("weight")] + "weight_scale_inv"


def _is_torch(t) -> bool:
    return type(t).__module__.startswith("torch")


def _float8(t) -> bool:
    return t.dtype.itemsize == 1 and t.dtype.is_floating_point


def _cat(parts):
    if _is_torch(parts[0]):
        import torch

        if _float8(parts[0]):  # e4m3 bytes moved as bytes: exact, whatever cat supports
            return torch.cat([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)
        return torch.cat(parts)
    import numpy as np

    return np.concatenate(parts)


def _stack(parts):
    if _is_torch(parts[0]):
        import torch

        if _float8(parts[0]):
            return torch.stack([p.view(torch.uint8) for p in parts]).view(parts[0].dtype)
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
        raise ConfigError(
            f"{name}: a rollout slice of {held} rows is not a vocabulary shard of T={s.tp}: "
            'use format="hf"'
        )
    need_lo, need_hi = lo, min(hi, s.vocab)
    if need_lo < need_hi and not (first <= need_lo and need_hi <= first + held):
        raise ConfigError(
            f"{name}: vLLM's rank {rank} holds vocabulary rows {lo}..{hi} (padded to "
            f"{s.padded}), this rank's rollout slice holds rows {first}..{first + held}: the "
            'vocabulary must be a multiple of 64 x T for vLLM\'s split, or use format="hf"'
        )
    rows = t[max(need_lo - first, 0) : max(need_hi - first, 0)]
    pad = s.vocab_local - rows.shape[0]
    if pad == 0:
        return rows
    return _cat([rows, _zero_rows(rows, pad)])




class _Part:
    """Rows ``lo..hi`` of the rollout tensor ``name``, with its fp8 scales where it has them."""

    def __init__(self, hf: dict, name: str, lo: int = 0, hi: int | None = None):
        self.name, self.t = name, hf[name]
        self.lo, self.hi = lo, self.t.shape[0] if hi is None else hi
        self.scales = hf.get(_scale_name(name)) if name.endswith("weight") else None

    def rows(self):
        return self.t[self.lo : self.hi]


def _fused(fused: str, parts: list[_Part]):
    """The parts' rows stacked into vLLM's fused tensor ``fused``, and its scales: ``None`` for
    bf16 parts; for fp8 parts their scale rows stacked, which is vLLM's block grid over the
    fused rows only where every part but the last fills whole 128-row blocks (refused
    otherwise, naming the part)."""
    from ._lifecycle import ConfigError

    fp8 = [p.scales is not None for p in parts]
    t = _cat([p.rows() for p in parts])
    if not any(fp8):
        return t, None
    if not all(fp8):
        raise ConfigError(
            f"{fused}: its parts are fp8 and bf16 ({', '.join(p.name for p in parts)}): vLLM "
            "quantises a fused tensor whole (keep all of them bf16, or none)"
        )
    scales = []
    for i, p in enumerate(parts):
        whole = p.hi if i == len(parts) - 1 and p.hi == p.t.shape[0] else p.hi - p.hi % BLOCK
        if p.lo % BLOCK or whole != p.hi:
            raise ConfigError(
                f"{fused}: fp8 rows {p.lo}..{p.hi} of {p.name} do not fill whole {BLOCK}-row "
                "blocks, so one of vLLM's scale blocks over the fused rows would straddle two "
                'parts: use format="hf" (each tensor with its own scales) or keep it bf16 '
                '(fp8_keep)'
            )
        scales.append(p.scales[p.lo // BLOCK : _blocks(p.hi)])
    return t, _cat(scales)


def vllm_tensors(config: Any, hf: dict, tp: int, rank: int) -> Iterator[tuple[str, Any]]:
    """The rollout tensors of one rank (``hf``: rollout names → torch tensors or numpy arrays)
    as vLLM's runtime parameters: fused ones concatenated (new tensors), the others as they
    are; an fp8 matrix followed by its ``weight_scale_inv`` (stacked for a fused one), as
    ``vllm_names(..., dtype="fp8")`` lists them."""
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
    names = vllm_names(c, tp, experts=experts)
    s = _Shape(c, tp)
    moe_scales: list[tuple[str, Any]] = []
    for name, shape in names:
        p, _, suffix = name.rpartition("mlp.") if ".mlp." in name else name.rpartition("self_attn.")
        scale = None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = _vocab_shard(name, hf[name], s, rank)
        elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            kind = "weight" if name.endswith("weight") else "bias"
            parts = [_Part(hf, f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
            if parts[1].t.shape[0] != s.kv_local * s.hd:  # kv heads replicated: keep this rank's
                heads = s.kv_head(rank)
                for part in parts[1:]:
                    part.lo, part.hi = heads.start * s.hd, heads.stop * s.hd
            t, scale = _fused(name, parts)
        elif name.endswith("gate_up_proj.weight"):
            parts = [_Part(hf, f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")]
            t, scale = _fused(name, parts)
        elif name.endswith("experts.w13_weight") or name.endswith("experts.w2_weight"):
            ids = sorted(
                {
                    int(n[len(p) + len("mlp.experts.") :].split(".")[0])
                    for n in hf
                    if n.startswith(p + "mlp.experts.")
                }
            )
            ex = lambda e, x: _Part(hf, f"{p}mlp.experts.{e}.{x}_proj.weight")  # noqa: E731
            if name.endswith("w13_weight"):
                per = [_fused(name, [ex(e, "gate"), ex(e, "up")]) for e in ids]
            else:
                per = [_fused(name, [ex(e, "down")]) for e in ids]
            t = _stack([w for w, _ in per])
            if per and per[0][1] is not None:
                moe_scales.append((name + "_scale_inv", _stack([sc for _, sc in per])))
        else:
            t = hf[name]
            if name.endswith("weight"):
                scale = hf.get(_scale_name(name))
        if list(t.shape) != shape:
            raise ConfigError(
                f"{name}: built shape {list(t.shape)}, vLLM's is {shape}; this is a bug of the "
                'package: use format="hf" and report it'
            )
        yield name, t
        if scale is not None:
            yield _scale_name(name), scale
        if name.endswith("experts.w2_weight"):
            # FusedMoE registers both weights, then both scales
            yield from moe_scales
            moe_scales = []
