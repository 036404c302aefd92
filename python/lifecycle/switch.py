"""The switch: training tensors a trainer owns, switched lazily into the rollout layout."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence

from . import _lifecycle
from ._lifecycle import ConfigError, StaleWeightsError, TensorMismatchError
from .sources import (
    _check_array,
    _chunks,
    _HostArrays,
    _is_torch,
    _positive,
    _set_writeable,
    _Source,
)
from ._config import _config_json
from ._lora import adapted_modules, is_adapter, lora_args, peft_key
from .vllm import vllm_tensors

Dtype = Literal["bf16", "fp8"]
Experts = Literal["tp", "ep"]
Offload = Literal["none", "params", "optimizer", "all"]
Switching = Literal["lazy", "eager"]
Format = Literal["hf", "vllm", "peft"]


def _current_gpu() -> int:
    import torch

    return torch.cuda.current_device()


def _flat(versions: Any) -> list[int]:
    """``versions`` (nested tuples of counters, ``None`` where a tensor has none) as the flat
    list the extension compares: each item tagged (a tuple ``2, len``, a counter ``1, value``,
    ``None`` ``0``), so that two structures never flatten alike."""
    out: list[int] = []

    def walk(v: Any) -> None:
        if isinstance(v, (tuple, list)):
            out.extend((2, len(v)))
            for x in v:
                walk(x)
        elif v is None:
            out.append(0)
        else:
            out.extend((1, int(v)))

    walk(versions)
    return out


def _regather(module, device: str, world: int, rename=None):
    if device != "cpu" or world == 1:
        return None
    from ._torch import regather

    return regather(module, world, rename)


def expected_parameters(config: Any, *, lora: Any = None) -> list[tuple[str, list[int]]]:
    """The parameters (Hugging Face names, full shapes, checkpoint order) of the model
    ``config`` (a Hugging Face config, dict, JSON or path) describes; with ``lora`` (PEFT's
    ``LoraConfig`` or a dict of its fields) each adapted weight followed by its ``lora_A`` and
    ``lora_B``. What :meth:`Switch.from_arrays` takes."""
    return _lifecycle.expected_parameters(_config_json(config), lora_args(lora))


def _named(
    format: str, named: list[tuple[str, Any]], trained: frozenset[str] = frozenset()
) -> list[tuple[str, Any]]:
    """``named`` as ``format`` gives it: every tensor (``"hf"``), or what a PEFT adapter saves
    under PEFT's keys (``"peft"``): the LoRA adapters and the whole tensors ``trained`` beside
    them (:func:`lifecycle._lora.peft_key`)."""
    if format == "peft":
        adapted = adapted_modules(n for n, _ in named)
        return [(peft_key(n, adapted), t) for n, t in named if is_adapter(n) or n in trained]
    return named


def _tuples(named: Any, what: str, form: str) -> list[tuple]:
    """``named`` as a list of tuples of ``form``'s size: a dict's items, or an iterable of
    tuples; anything else a ConfigError naming ``what``."""
    if isinstance(named, Mapping):
        return list(named.items())
    if isinstance(named, (str, bytes)) or not hasattr(named, "__iter__"):
        raise ConfigError(
            f"{what}: expected a dict or an iterable of {form} tuples, found "
            f"{type(named).__name__}"
        )
    out = list(named)
    size = form.count(",") + 1
    for item in out:
        if not isinstance(item, tuple):
            raise ConfigError(
                f"{what}: expected tuples, found {type(item).__name__} {str(item)[:60]!r}"
            )
        if len(item) != size:
            raise ConfigError(f"{what}: expected {form} tuples, found a tuple of {len(item)}")
    return out


class Switch:
    """Training tensors a trainer owns, switched lazily into the rollout layout.

    Build it with :meth:`from_fsdp2` (a PyTorch module wrapped in FSDP2), :meth:`from_peft` (a
    PEFT LoRA model), :meth:`from_megatron` (a Megatron-Core model and its distributed
    optimizer) or :meth:`from_arrays` / :meth:`from_shards` (host arrays, on the CPU reference
    backend).

    Settings (keywords of every constructor): ``rollout_tp`` (T); ``dtype`` ``"bf16"`` or
    ``"fp8"`` (block-scaled e4m3 matrices, quantised from the fp32 masters in the switch; the
    embedding, head, norms and router stay bf16); ``fp8_keep``, for an fp8 rollout, more
    matrices kept bf16: comma-separated ``attention`` and ``layer:N`` (``"none"`` by default);
    ``experts`` ``"tp"`` or ``"ep"``; ``offload``; ``switching`` ``"lazy"`` or ``"eager"``;
    ``lora`` (:meth:`from_arrays` / :meth:`from_shards`, :meth:`from_fsdp2`; :meth:`from_peft`
    reads the model's own): PEFT's ``LoraConfig`` or
    a dict of its ``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``,
    ``modules_to_save`` and ``bias``, the named tensors then including each adapted weight's
    ``lora_A`` / ``lora_B`` (:func:`lifecycle.expected_parameters` lists them): the base is
    frozen (cast once; a refresh moves the trained tensors alone, and a frozen weight written
    since is refused by name) and the rollout holds each adapter beside its base, split as its
    base is. The trained tensors are the adapters and the whole tensors trained beside them:
    the parameters of the modules ``modules_to_save`` names (e.g. ``["lm_head"]``:
    ``lm_head.weight``), and the biases ``bias`` trains (``"all"``: every bias,
    ``"lora_only"``: the adapted modules'; ``"none"`` by default).

    Every argument, and every tensor's dtype, layout, device and shape, is checked when the
    switch is built; a training weight that is not finite is refused when it is switched
    (:class:`NonFiniteError`). Rollout tensors handed out keep the switch's memory alive until
    the last of them goes, whatever is dropped first.

    ::

        switch = Switch.from_arrays(config, params)        # the arrays become read-only
        with switch.rollout() as w:                        # switches (the first time)
            weights = dict(w.named_arrays())
        with switch.update() as m:                         # the trainer writes through it
            m["lm_head.weight"] -= 0.1 * grad
        with switch.rollout() as w:                        # switches again: the weights changed
            ...
    """

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise ConfigError(
            "build a Switch with Switch.from_fsdp2, Switch.from_peft, Switch.from_megatron, "
            "Switch.from_arrays or Switch.from_shards"
        )

    @classmethod
    def _create(
        cls,
        config: Any,
        sources: list[_Source] | Callable[[Any], list[_Source]],
        *,
        world: int,
        rollout_tp: int = 1,
        dtype: Dtype = "bf16",
        fp8_keep: str = "none",
        experts: Experts = "tp",
        offload: Offload = "none",
        switching: Switching = "lazy",
        device: str = "cpu",
        offload_buffers=None,
        stream=None,
        regather=None,
        build=None,
        barrier=None,
        lora=None,
        shared=(),
    ) -> "Switch":
        """The switch over ``sources``: a list, built by the extension from their names; or,
        with ``build(config_json, tp)`` making the extension's switch, a callable giving the
        sources from that switch (a Megatron switch lists what it lends): one list, or a list
        per local rank (every rank's own parameters). ``barrier``, where other processes'
        tensors are read, runs before and after every switch that reads them. ``shared``: the
        frozen bf16 base the rollout reads in place (:func:`._torch.shared_base`), held here
        (the switch keeps them alive) and checked at every rollout."""
        self = cls.__new__(cls)
        self._s = None
        world = _positive("world", world, "the trainer's FSDP world size W")
        tp = _positive("rollout_tp", rollout_tp, "the rollout's tensor-parallel degree T")
        for what, value in (
            ("dtype", dtype),
            ("fp8_keep", fp8_keep),
            ("experts", experts),
            ("offload", offload),
            ("switching", switching),
        ):
            if not isinstance(value, str):
                raise ConfigError(f"{what}: expected a string, found {type(value).__name__}")
        self._config_json = _config_json(config)
        per_rank = None
        largs = None
        if build is None:
            for src in sources:
                src.check(device)
            largs = lora_args(lora, [src.name for src in sources + list(shared)])
            s = _lifecycle._Switch(
                self._config_json,
                [(src.name, src.shape) for src in sources],
                world=world,
                tp=tp,
                dtype_name=dtype,
                experts_name=experts,
                offload=offload,
                switching=switching,
                device=device,
                gpu=_current_gpu() if device == "cuda" else 0,
                fp8_keep=fp8_keep,
                lora=largs,
                shared=[(src.name, src.shape, src.shards[0].data_ptr()) for src in shared],
            )
        else:
            s = build(self._config_json, tp)
            made = sources(s)
            per_rank = made if made and isinstance(made[0], list) else None
            sources = [src for r in per_rank for src in r] if per_rank is not None else made
            for src in sources:
                src.check(device)
        self._per_rank = per_rank
        self._barrier = barrier
        self._lora = lora is not None
        # the whole tensors trained beside the adapters (moved at every refresh with them)
        self._trained = frozenset(largs[4]) if largs is not None else frozenset()
        self._sources = sources
        # the shared base: each tensor kept (its storage alive while the switch is); the
        # extension records its versions and addresses now and checks them at every rollout
        self._shared = list(shared)
        if self._shared:
            self._check_shared(s)
        self._device = device
        self._torch = device == "cuda" or any(
            _is_torch(s) for src in sources for s in src.shards
        )
        s.check_shards(self._shards())
        self._offload_buffers = offload_buffers
        self._stream = stream
        self._regather = regather
        self._tp = tp
        self._dtype = dtype
        self._eager = switching == "eager"
        self._force = False
        self._in_rollout = False
        # whether the shards may have moved since they were last lent (a restored storage)
        self._may_have_moved = True
        self._offloads = offload != "none"
        self._session: RolloutWeights | None = None
        self._updating = False
        self.last_enter: tuple | None = None
        # numpy arrays change only through update(): read-only from now on
        _HostArrays.take(self._host_arrays())
        self._s = s
        return self

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_shards(
        cls,
        config: Any,
        shards: Iterable[tuple[str, Sequence[int], Sequence[Any]]],
        *,
        world: int,
        **settings: Any,
    ) -> "Switch":
        """Host shards: ``(name, full shape, [rank 0's shard, ..., rank W-1's])`` per tensor,
        each an fp32 array of that rank's dim-0 rows (FSDP2's chunks), on the CPU backend.

        The switch takes the numpy shards as they are (no copy) and makes them read-only: a
        trainer writes them through :meth:`update`. Torch tensors stay writable; their version
        counters tell the switch they changed."""
        world = _positive("world", world, "the trainer's FSDP world size W")
        sources = []
        for name, shape, per_rank in _tuples(shards, "shards", "(name, full shape, shards)"):
            if isinstance(per_rank, (str, bytes)) or not hasattr(per_rank, "__len__"):
                raise TensorMismatchError(
                    f"tensor `{name}`: a list of its {world} ranks' shards expected, found "
                    f"{type(per_rank).__name__}"
                )
            per_rank = list(per_rank)
            if len(per_rank) != world:
                raise TensorMismatchError(
                    f"tensor `{name}`: {len(per_rank)} shards given, the world has {world} ranks "
                    "(one shard per rank, empty ones included)"
                )
            sources.append(_Source(name, shape, per_rank, given=per_rank))
        return cls._create(config, sources, world=world, device="cpu", **settings)

    @classmethod
    def from_arrays(
        cls,
        config: Any,
        named: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        world: int = 1,
        **settings: Any,
    ) -> "Switch":
        """Full host arrays, a dict or ``(name, array)`` pairs, split into FSDP2's dim-0 chunks
        over ``world`` ranks (views, no copies), on the CPU backend.

        The switch takes the numpy arrays as they are and makes them read-only: a trainer
        writes them through :meth:`update` (an in-place write anywhere else raises numpy's
        ``ValueError: assignment destination is read-only``; views taken before the switch was
        built are not covered). Torch tensors stay writable; their version counters tell the
        switch they changed."""
        world = _positive("world", world, "the trainer's FSDP world size W")
        sources = []
        for name, a in _tuples(named, "named", "(name, array)"):
            _check_array(str(name), a, "cpu")
            rows = a.shape[0] if a.ndim else 0
            views = [a[lo:hi] for lo, hi in _chunks(rows, world)]
            sources.append(_Source(name, list(a.shape), views, given=a))
        return cls._create(config, sources, world=world, device="cpu", **settings)

    @classmethod
    def from_fsdp2(
        cls,
        module: Any,
        *,
        rollout_tp: int = 1,
        dtype: Dtype = "bf16",
        fp8_keep: str = "none",
        experts: Experts = "tp",
        offload: Offload = "none",
        optimizer: Any = None,
        switching: Switching = "lazy",
        config: Any = None,
        lora: Any = None,
    ) -> "Switch":
        """A module whose parameters are FSDP2 ``DTensor``s (``fully_shard``) — or plain
        tensors at W = 1 — with a Hugging Face ``config`` (``module.config`` by default).
        ``lora`` (PEFT's ``LoraConfig`` or a dict of its fields): the module holds each adapted
        weight's ``lora_A`` / ``lora_B`` beside it under those names (:meth:`from_peft` maps a
        PEFT model's); the base is frozen as :meth:`from_arrays` says.

        CUDA parameters are lent by address, zero-copy: each rank's ``to_local()`` shard (dim-0
        chunks). At W > 1 (one process per GPU, launched by torchrun) each process lends its own
        shards and the switch's ranks meet through torchrun's store; the project's engine then
        runs the W processes as one tensor-parallel group (``rollout_tp=W``). ``offload``
        ("none", "params", "optimizer", "all") moves the parameters' and ``optimizer``'s state
        storages to pinned host memory during rollout (``untyped_storage().resize_(0)`` and
        back); the switch then leaves rollout mode by itself before the module's next forward
        and the optimizer's next step.

        CPU parameters (gloo) are gathered from every rank and switched on the reference
        backend, the same on every rank. transformers 5's fused experts of a mixture-of-experts
        layer (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) are read as each
        expert's matrices, views of the parameter, at W = 1 (refused by name when sharded)."""
        return cls._from_module(
            module,
            rollout_tp=rollout_tp,
            dtype=dtype,
            fp8_keep=fp8_keep,
            experts=experts,
            offload=offload,
            optimizer=optimizer,
            switching=switching,
            config=config,
            lora=lora,
        )

    @classmethod
    def from_peft(
        cls,
        model: Any,
        *,
        rollout_tp: int = 1,
        dtype: Dtype = "bf16",
        fp8_keep: str = "none",
        switching: Switching = "lazy",
        optimizer: Any = None,
        offload: Offload = "none",
        adapter: str = "default",
    ) -> "Switch":
        """A PEFT LoRA model (``peft.get_peft_model`` over a transformers Qwen2 / Qwen3 model,
        plain on one device or FSDP2-sharded) and its adapter ``adapter``: the LoRA
        configuration is the model's own (``peft_config[adapter]``: ``r``, ``lora_alpha``,
        ``target_modules``, ``use_rslora``, ``modules_to_save``, ``bias``), the Hugging Face
        config its base model's.

        What the adapter trains moves at every refresh: the adapters, and the whole tensors
        trained beside them: PEFT's ``modules_to_save`` copy of a module (``lm_head``,
        ``embed_tokens``) stands for the module's tensors (``lm_head.modules_to_save.<adapter>
        .weight`` is ``lm_head.weight``; the frozen ``original_module`` beside it is not
        switched), and ``bias="all"`` / ``"lora_only"`` train every bias / the adapted modules'.
        Everything else is frozen: the first enter casts it, a refresh after an update moves the
        trained tensors alone, and a frozen weight written since (its version counter moved) is
        refused by name at the refresh, after which the next rollout casts every tensor again
        (the trained tensors alone move only while the rollout weights stay resident: after
        :meth:`train`, which releases them, the next rollout casts everything). A base loaded
        in bf16 (as PEFT users load it; PEFT keeps the adapters f32) is read in place: the
        switch lends and casts the rest alone, the engine reads the frozen bf16 tensors where
        the model keeps them, so the device holds the base once (one GPU: W = 1,
        ``rollout_tp=1``, ``dtype="bf16"``, the engine's unmerged mode; otherwise keep the base
        fp32). The switch holds those tensors as long as it lives and never offloads them; a
        written one is refused by name at the next rollout (the one after reads it as
        written), one moved elsewhere (``.data`` replaced, the model moved) at every rollout.
        ``dtype`` ``"bf16"`` or ``"fp8"`` (the base's matrices block-scaled e4m3, quantised once, the
        adapters bf16 beside them; ``fp8_keep`` as :meth:`from_fsdp2`'s);
        ``w.named_tensors("peft")`` yields what PEFT saves of the adapter (the adapters and the
        trained whole tensors) under PEFT's keys, and :class:`Engine` applies the adapters
        unmerged beside the base (bf16 or fp8, weight-only or W8A8). ``target_parameters`` and ``lora_bias`` are refused by name."""
        from ._lora import peft_name

        configs = getattr(model, "peft_config", None)
        if not isinstance(configs, dict) or adapter not in configs:
            raise ConfigError(
                f"from_peft: no LoRA adapter `{adapter}` on {type(model).__name__} (expected "
                "a model from peft.get_peft_model)"
            )
        lora = configs[adapter]
        for field, none in (
            ("target_parameters", None),
            ("lora_bias", False),
        ):
            value = getattr(lora, field, none)
            # PEFT normalises an unset target_parameters to an empty set on some models
            empty = isinstance(value, (list, tuple, set, frozenset)) and not value
            if value != none and not empty:
                raise ConfigError(
                    f"from_peft: LoraConfig.{field} = {value!r} is not switched yet: use "
                    f"{field}={none!r}"
                )
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return cls._from_module(
            model,
            rollout_tp=rollout_tp,
            dtype=dtype,
            fp8_keep=fp8_keep,
            experts="tp",
            offload=offload,
            optimizer=optimizer,
            switching=switching,
            config=getattr(base, "config", None),
            lora=lora,
            rename=lambda n: peft_name(n, adapter),
        )

    @classmethod
    def _from_module(
        cls,
        module: Any,
        *,
        rollout_tp: int,
        dtype: Dtype,
        fp8_keep: str,
        experts: Experts,
        offload: Offload,
        optimizer: Any,
        switching: Switching,
        config: Any,
        lora: Any,
        rename=None,
    ) -> "Switch":
        """:meth:`from_fsdp2` and :meth:`from_peft`: ``rename`` maps the module's parameter
        names to the model's."""
        config = config if config is not None else getattr(module, "config", None)
        if config is None:
            raise ConfigError("from_fsdp2: the module has no `config`; pass config=...")
        if not isinstance(offload, str):
            raise ConfigError(f"offload: expected a string, found {type(offload).__name__}")
        from ._torch import fsdp2_sources

        sources, world, device, buffers, stream, shared = fsdp2_sources(
            module, offload, optimizer, rename, share=lora is not None
        )
        switch = cls._create(
            config,
            sources,
            world=world,
            rollout_tp=rollout_tp,
            dtype=dtype,
            fp8_keep=fp8_keep,
            experts=experts,
            offload=offload,
            switching=switching,
            device=device,
            offload_buffers=buffers,
            stream=stream,
            regather=_regather(module, device, world, rename),
            lora=lora,
            shared=shared,
        )
        if offload != "none":
            # before FSDP2's own pre-forward hook (it all-gathers the shards)
            module.register_forward_pre_hook(lambda *_: switch._leave(), prepend=True)
            if optimizer is not None:
                optimizer.register_step_pre_hook(lambda *_: switch._leave())
        return switch

    @classmethod
    def from_megatron(
        cls,
        model: Any,
        optimizer: Any,
        config: Any,
        *,
        rollout_tp: int = 1,
        dtype: Dtype = "bf16",
        fp8_keep: str = "none",
        experts: Experts = "tp",
        offload: Offload = "none",
        switching: Switching = "lazy",
    ) -> "Switch":
        """A Megatron-Core ``GPTModel`` (in its ``DistributedDataParallel`` and
        ``Float16Module``, bf16, as Megatron's ``get_model`` builds it) and its optimizer
        (``get_megatron_optimizer``), with the Hugging Face ``config`` of the model it is.

        The switch reads the bf16 parameters in place, where DDP's buffers keep them (zero-copy,
        by address, on the current stream), into the fused rollout layout (``qkv_proj`` from
        the group-interleaved ``linear_qkv``, ``gate_up_proj`` from ``linear_fc1``, the
        vocabulary unpadded). Every parameter's name and shape is checked against the Megatron
        layout of ``config`` at the model's (TP, PP, DP) and its experts' (EP, ETP) before
        anything is read (the local and Transformer Engine specs' names both). The weights count
        as changed when the optimizer stepped (a hook on the torch optimizers inside it counts
        every step, also those the switch never saw: the distributed optimizer moves no version
        counter of the parameters), or when a parameter was written in place;
        :meth:`mark_changed` for anything else.

        ``offload`` moves training state to pinned host memory while the rollout runs and
        brings it back at :meth:`train`: ``"params"`` DDP's bf16 parameter buffers,
        ``"optimizer"`` the fp32 main parameters, the Adam moments and DDP's gradient buffers,
        ``"all"`` both (each storage released and restored in place: the parameters and
        ``main_grad`` stay views of them). Not with ranks sharing one GPU (a process cannot
        release another's memory).

        Several ranks (torchrun, a process per rank, each passing its own model): where each
        has a GPU of its own, every process's switch is its rank of one NCCL world; where all
        share one GPU (gloo), every process switches every rank, reading the others'
        parameters through CUDA IPC between barriers (each holds every rank's rollout)."""
        from ._megatron import (
            _unwrap,
            degrees,
            layout_rank,
            megatron_sources,
            offload_buffers,
            padded_vocab,
            placement,
            shared_gpu_sources,
        )

        if optimizer is None:
            warnings.warn(
                "from_megatron without an optimizer: only in-place writes to the parameters "
                "mark the weights changed (call mark_changed() after updating them otherwise)",
                stacklevel=2,
            )
        tp, pp, dp, ep, etp = degrees()
        world = tp * pp * dp
        ranks = placement(world)
        rank = layout_rank()
        if not isinstance(offload, str):
            raise ConfigError(f"offload: expected a string, found {type(offload).__name__}")
        buffers = None
        if offload != "none":
            if ranks == "shared-gpu":
                raise ConfigError(
                    f'from_megatron: offload="{offload}" with the job\'s {world} ranks sharing '
                    "one GPU: each process switches every rank and cannot release another "
                    'process\'s memory: use offload="none" there, or a GPU per rank'
                )
            if offload in ("optimizer", "all") and optimizer is None:
                raise ConfigError(
                    f'from_megatron: offload="{offload}" moves the optimizer state: pass the '
                    "optimizer"
                )
            if offload in ("params", "optimizer", "all"):
                buffers = offload_buffers(model, optimizer, offload)
        _, inner = _unwrap(model)
        vocab = padded_vocab(inner, tp)
        dtype_name, experts_name, keep = dtype, experts, fp8_keep

        def build(config_json: str, rollout: int):
            return _lifecycle._Switch.megatron(
                config_json,
                tp=tp,
                pp=pp,
                dp=dp,
                padded_vocab=vocab,
                rollout_tp=rollout,
                dtype_name=dtype_name,
                experts_name=experts_name,
                offload=offload,
                switching=switching,
                gpu=_current_gpu(),
                fp8_keep=keep,
                ranks=ranks,
                ep=ep,
                etp=etp,
            )

        import torch

        def stream() -> int:
            return torch.cuda.current_stream().cuda_stream

        if ranks == "shared-gpu":

            def sources(s):
                own = megatron_sources(model, optimizer, s.parameters(rank))
                return shared_gpu_sources(own, rank, world)

            def barrier() -> None:
                torch.cuda.synchronize()
                torch.distributed.barrier()

        else:

            def sources(s):
                return megatron_sources(model, optimizer, s.parameters())

            barrier = None

        return cls._create(
            config,
            sources,
            world=world,
            rollout_tp=rollout_tp,
            dtype=dtype,
            fp8_keep=fp8_keep,
            experts=experts,
            offload=offload,
            switching=switching,
            device="cuda",
            stream=stream,
            build=build,
            barrier=barrier,
            offload_buffers=buffers,
        )

    # ---- the lifecycle -------------------------------------------------------------------

    def _shards(self) -> list[list[tuple[int, int]]]:
        """Every local rank's ``(address, elements)`` of every tensor, now."""
        if self._per_rank is not None:
            return [[s.address(0) for s in rank] for rank in self._per_rank]
        ranks = len(self._sources[0].shards) if self._sources else 0
        return [[s.address(i) for s in self._sources] for i in range(ranks)]

    def _versions(self) -> tuple:
        return tuple([s.version() for s in self._sources])

    def mark_changed(self) -> None:
        """Forces the next rollout to switch (for torch tensors written without moving their
        version counter, e.g. through ``.data``)."""
        self._live()
        self._force = True

    def _check_shared(self, s=None) -> None:
        """The shared base before a rollout (the extension decides): a tensor whose parameter
        moved is refused by name at every rollout, tensors written since the last rollout once
        (the rollout after reads them as written, in place)."""
        if not self._shared:
            return
        versions = _flat(tuple(src.version() for src in self._shared))
        addresses = [src.versioned.data_ptr() for src in self._shared]
        (s or self._s).check_shared(versions, addresses)

    def _enter(self, refresh: bool, versions: tuple) -> tuple:
        """Switches if needed (the extension decides from the versions); returns
        ``(switched, generation, seconds in the switch)``."""
        self._check_shared()
        refresh = refresh or self._force
        seen = _flat(versions)
        reused = self._s.reuse(seen, refresh, self._may_have_moved)
        if reused is not None:
            self._in_rollout = True
            return reused
        if self._regather is not None and self._s.changed(seen, refresh):
            sources = self._regather()
            for src in sources:
                src.check(self._device)
            self._sources = sources
        stream = self._stream() if callable(self._stream) else None
        buffers = self._offload_buffers() if callable(self._offload_buffers) else None
        if self._barrier is not None:
            self._barrier()  # every process's writes done before any reads them
        entered = self._s.enter(self._shards(), seen, refresh, stream, buffers)
        if self._barrier is not None:
            self._barrier()  # every read done before any process writes again
        self._force = False
        self._in_rollout = True
        self._may_have_moved = False
        self.last_enter = entered
        return entered

    @contextmanager
    def rollout(self, *, refresh: bool = False) -> Iterator["RolloutWeights"]:
        """A rollout session: enters rollout mode only when the weights changed since the last
        enter (their version counters moved, a write through :meth:`update`, or
        ``refresh=True``), then yields the weights. Tensors taken from it are stale once the
        block ends; their memory stays valid as long as they are referenced."""
        live = self._live()
        if self._session is not None:
            raise ConfigError("a rollout session is already open on this switch: end it first")
        if self._updating:
            raise ConfigError(
                "the switch's weights are being updated: end the update() block first"
            )
        versions = self._versions()
        self._enter(refresh, versions)
        live.open_session()
        w = RolloutWeights(self, versions)
        self._session = w
        try:
            yield w
        finally:
            self._session = None
            live.close_session()
            if self._eager:
                # eager: leave rollout mode after every call, as stacks that wrap each call do
                self._leave()

    @contextmanager
    def update(self) -> Iterator["Masters"]:
        """The training weights, writable for the block: ``with switch.update() as m:`` then
        ``m[name] -= lr * g`` (in place) or ``m[name] = new`` (copied in, shape checked). Every
        tensor touched counts as changed: the next rollout switches. Outside the block a host
        switch's numpy arrays are read-only, so a trainer cannot change them unseen."""
        self._live()
        if self._session is not None:
            raise ConfigError("a rollout session is open: end it before updating the weights")
        if self._updating:
            raise ConfigError("an update() block is already open on this switch")
        arrays = [a for src in self._sources for a in src.host_arrays()]
        self._updating = True
        _set_writeable(arrays, True)
        try:
            yield Masters(self, writable=True)
        finally:
            _set_writeable(arrays, False)
            self._updating = False

    @property
    def masters(self) -> "Masters":
        """The training weights by name, read-only (write them in :meth:`update`)."""
        self._live()
        return Masters(self, writable=False)

    def _leave(self) -> None:
        if self._in_rollout and self._s is not None:
            self._s.exit()
            self._in_rollout = False
            self._may_have_moved = self._offloads

    def train(self) -> None:
        """Leaves rollout mode now (bringing offloaded state back); refused with
        :class:`TensorsInUseError` while handed-out rollout tensors are still referenced."""
        self._live()
        if self._session is not None:
            raise ConfigError("a rollout session is open: end it before training")
        self._leave()

    def _live(self):
        if self._s is None or self._s.closed:
            raise ConfigError(
                "this switch is closed (close() freed its memory): build a new one to roll out "
                "again"
            )
        return self._s

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._s is None or self._s.closed

    def close(self) -> None:
        """Leaves rollout mode (bringing offloaded state back into the trainer's storages) and
        frees the switch's memory; the switch cannot be used again, and a second call does
        nothing. Refused with :class:`TensorsInUseError` while handed-out rollout tensors are
        still referenced (nothing is released then)."""
        if self.closed:
            return
        if self._session is not None:
            raise ConfigError("a rollout session is open: end it before closing the switch")
        self._s.close()
        self._in_rollout = False
        _HostArrays.give_back(self._host_arrays())

    def _host_arrays(self) -> list[Any]:
        return [a for src in self._sources for a in src.host_arrays()]

    def __del__(self):
        s = getattr(self, "_s", None)
        if s is None or s.closed:
            return
        try:
            # the masters go back to the trainer (writable once no other switch holds them)
            _HostArrays.give_back(self._host_arrays())
            held = s.held()
            if held:
                warnings.warn(
                    f"a lifecycle.Switch was dropped while {len(held)} handed-out rollout "
                    f"tensor(s) still reference its weights (e.g. `{held[0]}`): its memory is "
                    "freed when the last of them goes; call switch.close() after dropping them "
                    "to free it at a known point",
                    ResourceWarning,
                    stacklevel=2,
                )
            elif self._in_rollout and self._offloads:
                # A switch dropped in rollout mode must not take offloaded training state with
                # it: bring it back (best effort: at interpreter exit torch may be gone already).
                self._leave()
        except Exception as e:  # noqa: BLE001 (no exception may escape __del__)
            warnings.warn(f"lifecycle.Switch dropped in rollout mode: {e}", RuntimeWarning)

    def held(self) -> list[str]:
        """Names of handed-out rollout tensors still referenced (empty once closed)."""
        return [] if self._s is None else self._s.held()

    def stats(self) -> dict:
        """Counts and times of the switches so far: ``enters`` and ``refreshes`` (switches that
        moved weights), ``exits`` (out of rollout mode), ``reuses`` (rollout calls that found
        current weights resident), ``switch_seconds``, ``generation``."""
        return dict(self._live().stats())

    @property
    def rollout_tp(self) -> int:
        """The rollout's tensor-parallel degree T."""
        return self._tp


class Masters(Mapping[str, Any]):
    """A switch's training weights by name (what the trainer gave: the full array, or the list
    of every rank's shard for :meth:`Switch.from_shards`). Writable only inside
    :meth:`Switch.update`."""

    def __init__(self, switch: Switch, writable: bool):
        self._switch = switch
        self._writable = writable
        self._by_name = {s.name: s for s in switch._sources}

    def _source(self, name: str) -> _Source:
        src = self._by_name.get(name)
        if src is None:
            raise TensorMismatchError(
                f"tensor `{name}`: not one of the switch's {len(self._by_name)} tensors "
                "(list them with list(switch.masters))"
            )
        return src

    def __getitem__(self, name: str) -> Any:
        src = self._source(name)
        if self._writable:
            self._check()
            # what is taken writable may be written in place: counts as changed
            src.wrote()
        return src.given if src.given is not None else src.shards

    def __setitem__(self, name: str, value: Any) -> None:
        src = self._source(name)
        if not self._writable:
            raise ConfigError(
                f"tensor `{name}`: the weights are read-only here: write them inside "
                "`with switch.update() as m:`"
            )
        self._check()
        src.write(value)

    def _check(self) -> None:
        if not self._switch._updating:
            raise StaleWeightsError("weights written after their update() block ended")

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


class RolloutWeights:
    """The rollout weights of one session (``with switch.rollout() as w``)."""

    def __init__(self, switch: Switch, versions: tuple):
        self._switch = switch
        self._versions = versions

    def _check(self, what: str) -> None:
        if self._switch._session is not self:
            raise StaleWeightsError(f"rollout weights used after their session ended ({what})")
        if self._switch._versions() != self._versions:
            changed = [
                s.name
                for s, v in zip(self._switch._sources, self._versions)
                if s.version() != v
            ]
            which = f"`{changed[0]}`" + (
                f" and {len(changed) - 1} more tensors" if len(changed) > 1 else ""
            )
            raise StaleWeightsError(
                f"the training weights changed during the session ({what}): {which} changed "
                "in place; take the rollout tensors in a new session (switch.rollout())"
            )

    def _check_format(self, format: str) -> None:
        if format not in ("hf", "vllm", "peft"):
            raise ConfigError(f'format `{format}`: expected "hf", "vllm" or "peft"')
        if format == "peft" and not self._switch._lora:
            raise ConfigError(
                'format="peft" yields LoRA adapters: this switch has none (build it with '
                "lora=...)"
            )

    def handles(self, rank: int = 0, *, bits: bool = False) -> list:
        """The rollout tensors of local rank ``rank`` as handles (``_Tensor``): DLPack
        exporters that raise :class:`StaleWeightsError` once stale. ``bits`` exports them as
        unsigned integers of their width (what numpy can import)."""
        self._check("handles")
        return self._switch._live().tensors(_rank(rank), bool(bits))

    def named_tensors(self, format: Format = "hf", rank: int = 0) -> Iterator[tuple[str, Any]]:
        """``(name, tensor)`` for every rollout tensor of local rank ``rank``: torch tensors
        (DLPack views of the rollout buffer, zero-copy) on a torch switch, handles otherwise.

        ``format="hf"``: the rollout layout's names (Hugging Face's at any T).
        ``format="vllm"``: vLLM's runtime names and rank-local shapes (fused ``qkv_proj``,
        ``gate_up_proj``, FusedMoE ``w13_weight`` / ``w2_weight``, the vocabulary padded as
        vLLM pads it); fused tensors are new tensors (one copy), the others views.
        ``format="peft"``: what PEFT saves of a LoRA switch's adapter, under PEFT's state-dict
        keys: the adapters (``base_model.model.…q_proj.lora_A.weight``: what an engine serving
        LoRA loads) and the whole tensors trained beside them (``modules_to_save``, trainable
        biases: ``base_model.model.lm_head.weight``, an adapted module's bias under its
        ``base_layer``)."""
        self._check("named_tensors")
        self._check_format(format)
        handles = self._switch._live().tensors(_rank(rank), False)
        if not self._switch._torch:
            if format == "vllm":
                raise ConfigError('format="vllm" yields torch tensors: it needs a torch switch')
            yield from _named(format, [(h.name, h) for h in handles], self._switch._trained)
            return
        from ._torch import to_torch

        named = [(h.name, to_torch(h)) for h in handles]
        # the shared base: the trainer's own tensors, which the rollout reads in place
        named += [(src.name, src.shards[0]) for src in self._switch._shared]
        if format != "vllm":
            yield from _named(format, named, self._switch._trained)
        else:
            yield from vllm_tensors(
                self._switch._config_json, dict(named), self._switch._tp, rank
            )

    def named_arrays(self, format: Format = "hf", rank: int = 0) -> Iterator[tuple[str, Any]]:
        """``(name, numpy array)`` for every rollout tensor of local rank ``rank`` of a host
        switch: the bits of bf16 (``uint16``) and fp8 (``uint8``) tensors, zero-copy views in
        ``format="hf"``; ``format="vllm"`` as in :meth:`named_tensors` (fused arrays are
        copies). Concatenation moves bits unchanged, so the fused arrays are the exact bits."""
        self._check("named_arrays")
        self._check_format(format)
        if self._switch._device != "cpu":
            raise ConfigError("named_arrays reads host memory: use named_tensors on a cuda switch")
        import numpy as np

        handles = self._switch._live().tensors(_rank(rank), True)
        named = [(h.name, np.from_dlpack(h)) for h in handles]
        if format != "vllm":
            yield from _named(format, named, self._switch._trained)
        else:
            yield from vllm_tensors(
                self._switch._config_json, dict(named), self._switch._tp, rank
            )

    @property
    def generation(self) -> int:
        """The generation of these weights (one more at every switch)."""
        return int(self._switch._live().stats()["generation"])


def _rank(rank: Any) -> int:
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):
        raise ConfigError(f"rank: expected an int (a local rank), found {type(rank).__name__}")
    return int(rank.__index__())
