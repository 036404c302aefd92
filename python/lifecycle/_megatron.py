"""What a switch needs from a Megatron-Core model (imported only by ``Switch.from_megatron``):
its parallel degrees, its padded vocabulary, its bf16 parameters where its DDP buffers keep them
(each ``param.data`` a view into DDP's ``param_data``), matched by name to the switch's
Megatron layout, and what says they changed: the optimizer's steps (the distributed optimizer
writes the parameters through ``.data`` copies and all-gathers into ``param_data``, which moves
no version counter of theirs)."""

from __future__ import annotations

import re
from typing import Any

from ._config import _config_json
from ._lifecycle import ConfigError, TensorMismatchError
from .sources import _Source

# Transformer Engine's spec fuses the layer norms into the linear layers that follow them
_TE_NAMES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_weight$"), "pre_mlp_layernorm.weight"),
)
# SequentialMLP (the local spec's experts) names each expert's module; TEGroupedMLP (and the
# layout) numbers the weights
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
# a pipeline stage numbers its layers from 0; the layout numbers them as the whole model does
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def layout_name(name: str, first_layer: int = 0) -> str:
    """The layout's name of a Megatron-Core parameter: wrappers' ``module.`` prefixes dropped,
    a pipeline stage's layers numbered from the stage's ``first_layer`` (the model's layer
    index of its layer 0), Transformer Engine's fused norms and SequentialMLP's expert modules
    named as the layout names them.

    >>> layout_name("module.module.decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight")
    'decoder.layers.0.mlp.experts.linear_fc1.weight3'
    >>> layout_name("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight")
    'decoder.layers.1.input_layernorm.weight'
    >>> layout_name("module.decoder.layers.0.mlp.linear_fc2.weight", first_layer=14)
    'decoder.layers.14.mlp.linear_fc2.weight'
    """
    while name.startswith("module."):
        name = name[len("module."):]
    if first_layer:
        name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + first_layer}.", name)
    m = _LOCAL_EXPERT.search(name)
    if m:
        return name[: m.start()] + f"mlp.experts.{m.group(2)}.weight{m.group(1)}"
    for pattern, local in _TE_NAMES:
        m = pattern.search(name)
        if m:
            return name[: m.start()] + local
    return name


def megatron_parameters(
    config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    padded_vocab: int | None = None,
    rank: int = 0,
    ep: int = 1,
    etp: int | None = None,
) -> list[tuple[str, list[int]]]:
    """Megatron-Core's parameters of ``config`` (a Hugging Face config, dict, JSON or path) on
    global rank ``rank`` at ``(tp, pp, dp)``, a mixture-of-experts model's experts split over
    ``ep`` expert-parallel ranks and ``etp`` expert tensor-parallel ones (``tp`` where None):
    ``(name, shape)`` in the order a Megatron switch lends them, names as Megatron-Core's local
    spec registers them (:func:`layout_name` gives every spec's names in these terms; an
    expert's ``weight{j}`` is the rank's ``j``-th local expert), the embedding padded to
    ``padded_vocab`` rows (the model's ``vocab_size``; Megatron's default rule, a multiple of
    128 x TP, where None). What ``Switch.from_megatron`` checks a live model against, computed
    by the Rust library."""
    from ._lifecycle import megatron_parameters as names
    from .sources import _positive

    degrees = [
        _positive(what, v, meaning)
        for what, v, meaning in (
            ("tp", tp, "Megatron's tensor-parallel degree"),
            ("pp", pp, "Megatron's pipeline-parallel degree"),
            ("dp", dp, "Megatron's data-parallel degree"),
        )
    ]
    ep = _positive("ep", ep, "Megatron's expert-parallel degree")
    if etp is not None:
        etp = _positive("etp", etp, "Megatron's expert tensor-parallel degree")
    if padded_vocab is not None:
        padded_vocab = _positive("padded_vocab", padded_vocab, "the embedding's rows")
    if isinstance(rank, bool) or not hasattr(rank, "__index__") or int(rank) < 0:
        raise ConfigError(f"rank: expected a global rank (an int from 0), found {rank!r}")
    return names(_config_json(config), *degrees, padded_vocab, int(rank), ep, etp)


def _unwrap(model: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers (``.module``)."""
    import torch

    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ConfigError(
                f"from_megatron: {len(model)} model chunks given (virtual pipeline stages); "
                "one model per process is supported: pass model[0] without "
                "virtual_pipeline_model_parallel_size"
            )
        model = model[0]
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
        inner = inner.module
    return model, inner


def degrees() -> tuple[int, int, int, int, int]:
    """Megatron-Core's (TP, PP, DP, EP, ETP) of this process (``megatron.core.parallel_state``):
    the dense layers' degrees and the expert layers' expert- and expert tensor-parallel ones."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError as e:
        raise ConfigError(f"from_megatron needs megatron-core installed ({e})") from None
    if not ps.model_parallel_is_initialized():
        raise ConfigError(
            "from_megatron: Megatron-Core's model parallel state is not initialised: call "
            "parallel_state.initialize_model_parallel(...) before building the model"
        )
    cp = ps.get_context_parallel_world_size()
    if cp != 1:
        raise ConfigError(
            f"from_megatron: context parallelism of {cp}: only CP = 1 is supported (each rank "
            "holds whole parameters whatever CP is: build the switch's model at CP = 1)"
        )
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    )


def layout_rank() -> int:
    """This process's rank in the switch's Megatron layout (TP fastest, then DP, then PP: the
    order of Megatron-Core's default ``tp-cp-ep-dp-pp``; the expert layers' ETP, EP, expert DP,
    PP in the same order), checked against torch.distributed's rank where a job has several."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, dp = ps.get_tensor_model_parallel_world_size(), ps.get_data_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank() + tp * (
        ps.get_data_parallel_rank() + dp * ps.get_pipeline_model_parallel_rank()
    )
    etp, ep = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    experts = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_model_parallel_rank())
    order = dist.is_initialized() and dist.get_rank() != rank
    if order or experts != (rank % etp, rank // etp % ep):
        raise ConfigError(
            f"from_megatron: rank {dist.get_rank() if dist.is_initialized() else 0} has Megatron "
            f"coordinates (tp {ps.get_tensor_model_parallel_rank()}, dp "
            f"{ps.get_data_parallel_rank()}, pp {ps.get_pipeline_model_parallel_rank()}; etp "
            f"{experts[0]}, ep {experts[1]}), not rank {rank}'s in the order the switch assumes "
            "(Megatron-Core's default tp-cp-ep-dp-pp): initialise the model parallel state with "
            "that order"
        )
    return rank


def placement(world: int) -> str:
    """How the job's ranks use GPUs: ``"process"`` (one rank, or one GPU per process: the
    switch's ranks talk over NCCL) or ``"shared-gpu"`` (every rank on one GPU of one host)."""
    if world == 1:
        return "process"
    import socket

    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != world:
        found = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise ConfigError(
            f"from_megatron: TP x PP x DP = {world} ranks, torch.distributed has {found}: "
            "every rank of the job must be a rank of the model"
        )
    me = (socket.gethostname(), torch.cuda.current_device())
    every: list[Any] = [None] * world
    dist.all_gather_object(every, me)
    if all(e == me for e in every):
        return "shared-gpu"
    if len(set(every)) == world:
        return "process"
    raise ConfigError(
        f"from_megatron: the ranks' (host, GPU) are {every}: either every rank on a GPU of its "
        "own, or all of them on one GPU"
    )


def first_layer(inner: Any) -> int:
    """The model's index of this pipeline stage's first layer (0 without pipeline stages)."""
    layers = getattr(getattr(inner, "decoder", None), "layers", None)
    if not layers:
        return 0
    number = getattr(layers[0], "layer_number", None)
    return int(number) - 1 if isinstance(number, int) else 0


def padded_vocab(inner: Any, tp: int) -> int:
    """The vocabulary the model's embedding (or output layer) is padded to."""
    v = getattr(inner, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    for name, p in inner.named_parameters():
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            return int(p.shape[0]) * tp
    raise ConfigError("from_megatron: the model has neither vocab_size nor an embedding")


def check_overlap(model: Any) -> None:
    """DDP's ``overlap_param_gather`` lands the updated parameters at the next forward: the
    switch would read the old ones. Refused by name."""
    cfg = getattr(model, "ddp_config", None)
    if cfg is not None and getattr(cfg, "overlap_param_gather", False):
        raise ConfigError(
            "from_megatron: DistributedDataParallelConfig(overlap_param_gather=True) gathers "
            "the updated parameters at the next forward, after a switch would read them: build "
            "DDP with overlap_param_gather=False"
        )


def _attr(o: Any, name: str) -> Any:
    """``o.name``, or None where it is absent or its property raises."""
    try:
        return getattr(o, name, None)
    except Exception:  # a wrapper's property that does not apply to it
        return None


def torch_optimizers(optimizer: Any) -> list:
    """The torch optimizers inside a Megatron optimizer (``ChainedOptimizer`` over
    ``DistributedOptimizer`` s, each over a torch optimizer), each once, in the chain's order."""
    import torch

    inner: dict[int, Any] = {}
    stack = [optimizer]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.optim.Optimizer):
            inner.setdefault(id(o), o)
            continue
        stack.extend(reversed(_attr(o, "chained_optimizers") or []))
        wrapped = _attr(o, "optimizer")
        if wrapped is not None and wrapped is not o:
            stack.append(wrapped)
    if not inner:
        raise ConfigError(
            f"from_megatron: no torch optimizer inside {type(optimizer).__name__} "
            "(expected get_megatron_optimizer's ChainedOptimizer or DistributedOptimizer)"
        )
    return list(inner.values())


def offload_buffers(model: Any, optimizer: Any, offload: str):
    """What an offload moves, as a callable giving each enter's list (one local rank): with
    ``"params"`` / ``"all"`` DDP's bf16 ``param_data`` buffers (the parameters are views into
    them), with ``"optimizer"`` / ``"all"`` the fp32 main parameters and Adam moments (every CUDA
    tensor the torch optimizers inside ``optimizer`` hold) and DDP's ``grad_data`` buffers. Each
    storage moves whole, released and restored in place (views stay valid)."""
    from ._torch import lent_storages

    wrapper, _ = _unwrap(model)

    def listed(name: str) -> list:
        # Megatron's DDP sets these lists as attributes (`buffers` shadows Module.buffers())
        v = _attr(wrapper, name)
        return list(v) if isinstance(v, (list, tuple)) else []

    ddp = [
        b
        for b in listed("buffers") + listed("expert_parallel_buffers")
        if _attr(b, "param_data") is not None
    ]
    if not ddp:
        raise ConfigError(
            f'from_megatron: offload="{offload}" moves DDP\'s parameter and gradient buffers: '
            "wrap the model in Megatron-Core's DistributedDataParallel"
        )
    params = offload in ("params", "all")
    optim = offload in ("optimizer", "all")
    inner = torch_optimizers(optimizer) if optim else []

    def buffers() -> list[list[tuple]]:
        import torch

        tensors = []
        if params:
            tensors += [(f"param_data[{i}]", "params", b.param_data) for i, b in enumerate(ddp)]
        for k, o in enumerate(inner):
            for g, group in enumerate(o.param_groups):
                for j, p in enumerate(group["params"]):
                    where = f"optimizer {k} group {g} main parameter {j}"
                    if p.is_cuda:
                        tensors.append((where, "optimizer", p.data))
                    for key, t in o.state.get(p, {}).items():
                        if isinstance(t, torch.Tensor) and t.is_cuda:
                            tensors.append((f"{where}: {key}", "optimizer", t))
        if optim:
            tensors += [
                (f"grad_data[{i}]", "optimizer", b.grad_data)
                for i, b in enumerate(ddp)
                if _attr(b, "grad_data") is not None
            ]
        return [lent_storages(tensors)]

    return buffers


class StepCount:
    """Steps of the torch optimizers inside a Megatron optimizer (``ChainedOptimizer`` over
    ``DistributedOptimizer`` s, each over a torch optimizer), counted by a post-step hook on
    each: every step moves it, including steps the switch never saw."""

    def __init__(self, optimizer: Any):
        self.steps = 0
        self.hooks = [o.register_step_post_hook(self._stepped) for o in torch_optimizers(optimizer)]

    def _stepped(self, *_args: Any) -> None:
        self.steps += 1


class MegatronSource(_Source):
    """One Megatron-Core parameter: its bf16 tensor in place (a view into DDP's buffer), what
    changed it (its own counter for writes through it, and the optimizer's steps)."""

    def __init__(self, name: str, param: Any, steps: StepCount | None):
        super().__init__(name, list(param.shape), [param.data], param, given=None)
        self.steps = steps

    def version(self) -> Any:
        return (
            getattr(self.versioned, "_version", None),
            self.steps.steps if self.steps is not None else None,
        )

    def check(self, device: str) -> None:
        import torch

        t = self.shards[0]
        if t.dtype != torch.bfloat16:
            raise TensorMismatchError(
                f"tensor `{self.name}`: bf16 parameters expected, found {t.dtype}: build the "
                "model with TransformerConfig(bf16=True, params_dtype=torch.bfloat16) and wrap "
                "it in Float16Module (as Megatron's get_model does), so every parameter, norms "
                "included, lives in DDP's bf16 buffer"
            )
        if not t.is_cuda:
            raise TensorMismatchError(f"tensor `{self.name}`: on {t.device}, CUDA expected")
        if not t.is_contiguous():
            raise TensorMismatchError(f"tensor `{self.name}`: not contiguous")
        self._numel[0] = t.numel()

    def host_arrays(self) -> list[Any]:
        return []


def megatron_sources(model: Any, optimizer: Any, switch_parameters: list) -> list:
    """The sources of ``model``'s parameters in the order the switch lends them
    (``switch_parameters``: the layout's names and this rank's shapes), each checked by name:
    a parameter the layout lacks, one it needs that the model lacks, and a shape that differs
    are refused before anything is read."""
    wrapper, inner = _unwrap(model)
    check_overlap(wrapper)
    steps = StepCount(optimizer) if optimizer is not None else None
    first = first_layer(inner)
    by_name: dict[str, tuple[str, Any]] = {}
    for name, p in inner.named_parameters():
        local = layout_name(name, first)
        if local in by_name:
            raise TensorMismatchError(
                f"tensor `{name}`: named `{local}` in the layout, as is `{by_name[local][0]}`"
            )
        by_name[local] = (name, p)
    wanted = {n for n, _ in switch_parameters}
    for local, (name, _) in by_name.items():
        if local not in wanted:
            raise TensorMismatchError(
                f"tensor `{name}`: not a parameter of this model's Megatron layout (its "
                f"{len(wanted)} parameters are names such as "
                f"`{switch_parameters[0][0] if switch_parameters else ''}`): check the config "
                "passed matches the model"
            )
    sources = []
    for local, shape in switch_parameters:
        if local not in by_name:
            raise TensorMismatchError(
                f"tensor `{local}`: missing from the model (the config describes it): check the "
                "config passed matches the model"
            )
        name, p = by_name[local]
        if list(p.shape) != list(shape):
            raise TensorMismatchError(
                f"tensor `{name}`: the layout gives this rank's part shape {list(shape)}, the "
                f"model's is {list(p.shape)}"
            )
        sources.append(MegatronSource(local, p, steps))
    return sources


def shared_gpu_sources(own: list, rank: int, world: int) -> list[list]:
    """Every rank's sources, in layout rank order, where the job's ranks share this process's
    GPU: this rank's ``own`` and the others' parameters opened through CUDA IPC (torch's
    ``reduce_tensor``, exchanged over torch.distributed). Their changes are the optimizer's
    steps of this rank (every rank steps together)."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    mine = (rank, [(s.name, reduce_tensor(s.shards[0])) for s in own])
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    steps = own[0].steps if own else None
    per_rank: list[list] = [[] for _ in range(world)]
    for r, items in every:
        if r == rank:
            per_rank[r] = own
            continue
        per_rank[r] = [MegatronSource(name, fn(*args), steps) for name, (fn, args) in items]
    return per_rank
