"""What the switch needs from torch (imported only when torch tensors are used)."""

from __future__ import annotations

from typing import Any

import torch

from ._lifecycle import ConfigError, TensorMismatchError


def to_torch(handle) -> torch.Tensor:
    """A torch tensor viewing a rollout tensor handle (DLPack, zero-copy); fp8 travels as bytes
    and is viewed as ``float8_e4m3fn``."""
    if handle.dtype_name == "float8_e4m3fn":
        return torch.from_dlpack(handle.bits()).view(torch.float8_e4m3fn)
    return torch.from_dlpack(handle)


def _local(p) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p.data


def fsdp2_sources(module, offload: str, optimizer, rename=None, share: bool = False):
    """The switch's sources for an FSDP2 module: names, full shapes, this rank's local shard of
    each parameter, its versioned object (the parameter itself: ``optimizer.step()`` moves the
    DTensor's counter, not its local tensor's), the world, the device, callables giving the
    offload buffers and the current stream at each enter, and, with ``share`` (a LoRA model),
    the frozen base the rollout reads in place (:func:`shared_base`: apart from the sources, and
    never offloaded). ``rename`` maps the module's parameter names to the model's (a PEFT
    model's: ``peft_name``); a parameter it maps to None is not switched."""
    from .sources import _Source

    named = _renamed(module, rename)
    if not named:
        raise ConfigError(
            "from_fsdp2: the module has no parameters: pass the model whose weights roll out"
        )
    world, mesh_dims = 1, set()
    for name, p in named:
        spec = getattr(p, "placements", None)
        if spec is not None:
            mesh = p.device_mesh
            if mesh.ndim != 1 or len(spec) != 1 or not spec[0].is_shard() or spec[0].dim != 0:
                raise TensorMismatchError(
                    f"tensor `{name}`: FSDP2 Shard(0) on a 1-D mesh expected, found {spec} on "
                    f"a {mesh.ndim}-D mesh: shard the module with fully_shard over one mesh "
                    "dimension"
                )
            mesh_dims.add(mesh.size())
    if len(mesh_dims) > 1:
        raise ConfigError(
            f"from_fsdp2: the parameters are sharded over meshes of sizes {sorted(mesh_dims)}; "
            "one mesh is expected: shard every parameter over the same mesh"
        )
    if mesh_dims:
        world = mesh_dims.pop()
    device = "cuda" if _local(named[0][1]).is_cuda else "cpu"
    fused = [n for n, p in named if fused_experts(n, p)]
    if fused and world > 1:
        raise ConfigError(
            f"tensor `{fused[0]}`: a mixture-of-experts layer's experts fused in one parameter "
            f"(transformers 5), sharded over {world} ranks: FSDP2 splits it by experts, which "
            "the switch reads only at W = 1 yet: run it on one GPU"
        )
    if device == "cpu" and world > 1:
        return _gathered(named, world) + (None, None, [])
    sources = [
        _Source(name, list(view.shape), [view], p)
        for n, p in named
        for name, view in expert_views(n, _local(p))
    ]
    shared = shared_base(sources) if share and device == "cuda" else []
    if shared:
        kept = {id(src) for src in shared}
        sources = [src for src in sources if id(src) not in kept]
        held = {id(src.versioned) for src in shared}
        named = [(n, p) for n, p in named if id(p) not in held]

    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    buffers = None
    if device == "cuda" and offload != "none":
        params = offload in ("params", "all")
        optim = offload in ("optimizer", "all")
        if optim and optimizer is None:
            raise ConfigError(f'offload="{offload}" moves optimizer state: pass optimizer=...')

        def buffers() -> list[list[tuple]]:
            tensors = []
            if params:
                tensors += [(n, "params", _local(p)) for n, p in named]
            if optim:
                for n, p in named:
                    for key, t in optimizer.state.get(p, {}).items():
                        if isinstance(t, torch.Tensor) and _local(t).is_cuda:
                            tensors.append((f"{n}:{key}", "optimizer", _local(t)))
            return [lent_storages(tensors)]

    return sources, world, device, buffers, stream if device == "cuda" else None, shared


def shared_base(sources) -> list:
    """The sources the rollout reads in place: frozen (``requires_grad`` off) bf16 tensors on
    the GPU, each one tensor of this process (a LoRA model's base loaded in bf16). The switch
    neither lends nor casts them: its engine reads them where they are, so the device holds the
    base once. A non-contiguous one is refused by name."""
    out = []
    for src in sources:
        p = src.versioned
        if len(src.shards) != 1 or getattr(p, "requires_grad", True):
            continue
        t = src.shards[0]
        if not (t.is_cuda and t.dtype == torch.bfloat16):
            continue
        if not t.is_contiguous():
            raise TensorMismatchError(
                f"tensor `{src.name}`: a frozen bf16 base tensor is read in place, and this one "
                "is not contiguous: make it contiguous, or keep the base in fp32"
            )
        out.append(src)
    return out


# transformers 5's fused experts of a mixture-of-experts layer, by the parameter's last name:
# `gate_up_proj` [experts, 2 · ffn, hidden] (each expert's gate rows, then its up rows) and
# `down_proj` [experts, hidden, ffn]
FUSED_EXPERTS = ".mlp.experts."


def fused_experts(name: str, p) -> bool:
    """Whether ``name`` is a mixture-of-experts layer's experts fused in one 3-D parameter
    (transformers 5's ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``)."""
    head, _, last = name.rpartition(".")
    return (
        p.dim() == 3
        and (head + ".").endswith(FUSED_EXPERTS)
        and last in ("gate_up_proj", "down_proj")
    )


def expert_views(name: str, t):
    """``[(name, t)]``, or for transformers 5's fused experts each expert's matrices as views
    of ``t`` under the per-expert names the model's layout gives them
    (``…experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``): zero-copy, the same
    storage and version counter as the parameter."""
    if not fused_experts(name, t):
        return [(name, t)]
    head, _, last = name.rpartition(".")
    if last == "down_proj":
        return [(f"{head}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
    if t.shape[1] % 2:
        raise TensorMismatchError(
            f"tensor `{name}`: fused gate / up rows of each expert expected (an even count), "
            f"found shape {list(t.shape)}"
        )
    f = t.shape[1] // 2
    return [
        (f"{head}.{e}.{part}_proj.weight", t[e, rows])
        for e in range(t.shape[0])
        for part, rows in (("gate", slice(0, f)), ("up", slice(f, 2 * f)))
    ]


def lent_storages(tensors: list[tuple[str, str, torch.Tensor]]) -> list[tuple]:
    """What an offload may move, from ``(name, class, tensor)``: each tensor's whole storage once,
    under its first name and class (views of one storage, e.g. parameters in a flat buffer,
    move together: an offload restores every byte of it), empty storages skipped, with its
    owner's ``release`` / ``restore``."""
    out, seen = [], set()
    for n, cls, t in tensors:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append((n, cls, st.data_ptr(), st.nbytes(), *_owner(st)))
    return out


def _owner(storage):
    """``release(rank, ptr)`` and ``restore(rank, bytes) -> ptr`` of a torch storage."""

    def release(_rank: int, _ptr: int) -> None:
        storage.resize_(0)

    def restore(_rank: int, nbytes: int) -> int:
        storage.resize_(nbytes)
        return storage.data_ptr()

    return release, restore


def _gathered(named, world: int):
    """CPU FSDP2 (gloo): every rank's local shard of every parameter, gathered on every rank,
    as the reference backend switches all W ranks."""
    from .sources import _Source

    sources = []
    for name, p in named:
        local = _local(p).contiguous()
        parts: list[Any] = [None] * world
        torch.distributed.all_gather_object(parts, local)
        sources.append(_Source(name, list(p.shape), [t.contiguous() for t in parts], p))
    return sources, world, "cpu"


def regather(module, world: int, rename=None):
    """A callable that gathers every rank's shards again (after the trainer changed them)."""
    named = _renamed(module, rename)
    return lambda: _gathered(named, world)[0]


def _renamed(module, rename=None) -> list[tuple[str, Any]]:
    """``module``'s parameters under the names ``rename`` gives them, those it maps to None
    left out."""
    if rename is None:
        return list(module.named_parameters())
    named = ((rename(n), p) for n, p in module.named_parameters())
    return [(n, p) for n, p in named if n is not None]
