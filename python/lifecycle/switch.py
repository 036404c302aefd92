"""The switch: training tensors a trainer owns, switched lazily into the rollout layout."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

from . import _lifecycle
from ._lifecycle import ConfigError, StaleWeightsError, TensorMismatchError
from .sources import _chunks, _is_torch, _Source
from .vllm import vllm_tensors


def _config_json(config: Any) -> str:
    """A Hugging Face config (object with ``to_json_string``), a dict, or JSON text."""
    if isinstance(config, str):
        return config
    if isinstance(config, dict):
        return json.dumps(config)
    to_json = getattr(config, "to_json_string", None)
    if to_json is not None:
        return to_json()
    raise ConfigError(
        f"config: expected a Hugging Face config, a dict or JSON text, found {type(config).__name__}"
    )


def _current_gpu() -> int:
    import torch

    return torch.cuda.current_device()


def _regather(module, device: str, world: int):
    if device != "cpu" or world == 1:
        return None
    from ._torch import regather

    return regather(module, world)


class Switch:
    """Training tensors a trainer owns, switched lazily into the rollout layout.

    Build it with :meth:`from_fsdp2` (a PyTorch module wrapped in FSDP2) or :meth:`from_shards`
    / :meth:`from_arrays` (host arrays, on the CPU reference backend).

    Settings (keywords of every constructor): ``rollout_tp`` (T); ``dtype`` ``"bf16"`` or
    ``"fp8"`` (block-scaled e4m3 matrices, quantised from the fp32 masters in the switch; the
    embedding, head, norms and router stay bf16); ``fp8_keep``, for an fp8 rollout, more
    matrices kept bf16: comma-separated ``attention`` and ``layer:N`` (``"none"`` by default);
    ``experts`` ``"tp"`` or ``"ep"``; ``offload``; ``switching`` ``"lazy"`` or ``"eager"``."""

    def __init__(
        self,
        config: Any,
        sources: list[_Source],
        *,
        world: int,
        rollout_tp: int = 1,
        dtype: str = "bf16",
        fp8_keep: str = "none",
        experts: str = "tp",
        offload: str = "none",
        switching: str = "lazy",
        device: str = "cpu",
        offload_buffers=None,
        stream=None,
        regather=None,
    ):
        self._config_json = _config_json(config)
        self._sources = sources
        self._device = device
        self._torch = device == "cuda" or any(
            _is_torch(s) for src in sources for s in src.shards
        )
        self._offload_buffers = offload_buffers
        self._stream = stream
        self._regather = regather
        self._tp = int(rollout_tp)
        self._s = _lifecycle._Switch(
            self._config_json,
            [(s.name, s.shape) for s in sources],
            world=int(world),
            tp=self._tp,
            dtype_name=dtype,
            experts_name=experts,
            offload=offload,
            switching=switching,
            device=device,
            gpu=_current_gpu() if device == "cuda" else 0,
            fp8_keep=fp8_keep,
        )
        self._dtype = dtype
        self._eager = switching == "eager"
        self._seen: tuple | None = None
        self._force = False
        self._in_rollout = False
        # whether the shards may have moved since they were last lent (a restored storage)
        self._may_have_moved = True
        self._offloads = offload != "none"
        self._session: RolloutWeights | None = None
        self.last_enter: tuple | None = None

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_shards(
        cls,
        config: Any,
        shards: Iterable[tuple[str, Sequence[int], Sequence[Any]]],
        *,
        world: int,
        **settings,
    ) -> "Switch":
        """Host shards: ``(name, full shape, [rank 0's shard, ..., rank W-1's])`` per tensor,
        each an fp32 array of that rank's dim-0 rows (FSDP2's chunks), on the CPU backend."""
        sources = []
        for name, shape, per_rank in shards:
            per_rank = list(per_rank)
            if len(per_rank) != world:
                raise TensorMismatchError(
                    f"tensor `{name}`: {len(per_rank)} shards given for a world of {world}"
                )
            sources.append(_Source(name, shape, per_rank, per_rank[0]))
        return cls(config, sources, world=world, device="cpu", **settings)

    @classmethod
    def from_arrays(
        cls, config: Any, named: Iterable[tuple[str, Any]], *, world: int = 1, **settings
    ) -> "Switch":
        """Full host arrays ``(name, array)``, split into FSDP2's dim-0 chunks over ``world``
        ranks (views, no copies), on the CPU backend."""
        shards = []
        for name, a in named:
            rows = a.shape[0] if a.ndim else 0
            views = [a[lo:hi] for lo, hi in _chunks(rows, world)]
            shards.append((name, list(a.shape), views))
        return cls.from_shards(config, shards, world=world, **settings)

    @classmethod
    def from_fsdp2(
        cls,
        module,
        *,
        rollout_tp: int = 1,
        dtype: str = "bf16",
        fp8_keep: str = "none",
        experts: str = "tp",
        offload: str = "none",
        optimizer=None,
        switching: str = "lazy",
        config: Any = None,
    ) -> "Switch":
        """A module whose parameters are FSDP2 ``DTensor``s (``fully_shard``) — or plain
        tensors at W = 1 — with a Hugging Face ``config`` (``module.config`` by default).

        CUDA parameters are lent by address, zero-copy: each rank's ``to_local()`` shard (dim-0
        chunks). At W > 1 (one process per GPU, launched by torchrun) each process lends its own
        shards and the switch's ranks meet through torchrun's store; the project's engine then
        runs the W processes as one tensor-parallel group (``rollout_tp=W``). ``offload`` ("none", "params", "optimizer", "all") moves the parameters'
        and ``optimizer``'s state storages to pinned host memory during rollout
        (``untyped_storage().resize_(0)`` and back); the switch then leaves rollout mode by
        itself before the module's next forward and the optimizer's next step.

        CPU parameters (gloo) are gathered from every rank and switched on the reference
        backend, the same on every rank."""
        from ._torch import fsdp2_sources

        config = config if config is not None else getattr(module, "config", None)
        if config is None:
            raise ConfigError("from_fsdp2: the module has no `config`; pass config=...")
        sources, world, device, buffers, stream = fsdp2_sources(module, offload, optimizer)
        switch = cls(
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
            regather=_regather(module, device, world),
        )
        if offload != "none":
            # before FSDP2's own pre-forward hook (it all-gathers the shards)
            module.register_forward_pre_hook(lambda *_: switch._leave(), prepend=True)
            if optimizer is not None:
                optimizer.register_step_pre_hook(lambda *_: switch._leave())
        return switch

    # ---- the lifecycle -------------------------------------------------------------------

    def _versions(self) -> tuple:
        return tuple([s.version() for s in self._sources])

    def mark_changed(self) -> None:
        """Forces the next rollout to switch (for tensors without a version counter)."""
        self._force = True

    def _enter(self, refresh: bool, versions: tuple) -> tuple:
        """Switches if needed; returns ``(switched, generation, seconds in the switch)``."""
        changed = refresh or self._force or self._seen is None or versions != self._seen
        if not changed and not self._may_have_moved:
            reused = self._s.reuse()
            if reused is not None:
                self._in_rollout = True
                return reused
        if changed and self._regather is not None:
            self._sources = self._regather()
        shards = [
            [s.address(i, self._device) for s in self._sources]
            for i in range(len(self._sources[0].shards) if self._sources else 0)
        ]
        stream = self._stream() if callable(self._stream) else None
        buffers = self._offload_buffers() if callable(self._offload_buffers) else None
        entered = self._s.enter(shards, changed, stream, buffers)
        self._seen = versions
        self._force = False
        self._in_rollout = True
        self._may_have_moved = False
        self.last_enter = entered
        return entered

    @contextmanager
    def rollout(self, *, refresh: bool = False) -> Iterator["RolloutWeights"]:
        """A rollout session: enters rollout mode only when the weights changed since the last
        enter (their in-place version counters moved, or ``refresh=True``), then yields the
        weights. Tensors taken from it are stale once the block ends."""
        if self._session is not None:
            raise ConfigError("a rollout session is already open on this switch")
        if self._s is None:
            raise ConfigError("this switch is closed")
        versions = self._versions()
        self._enter(refresh, versions)
        self._s.open_session()
        w = RolloutWeights(self, versions)
        self._session = w
        try:
            yield w
        finally:
            self._session = None
            self._s.close_session()
            if self._eager:
                # eager: leave rollout mode after every call, as stacks that wrap each call do
                self._leave()

    def _leave(self) -> None:
        if self._in_rollout:
            self._s.exit()
            self._in_rollout = False
            self._may_have_moved = self._offloads

    def train(self) -> None:
        """Leaves rollout mode now (bringing offloaded state back); refused with
        :class:`TensorsInUseError` while handed-out rollout tensors are still referenced."""
        if self._session is not None:
            raise ConfigError("a rollout session is open: end it before training")
        self._leave()

    def _live(self):
        if self._s is None:
            raise ConfigError("this switch is closed")
        return self._s

    def close(self) -> None:
        """Leaves rollout mode (bringing offloaded state back into the trainer's storages) and
        releases the switch's device memory; the switch cannot be used again. Refused with
        :class:`TensorsInUseError` while handed-out rollout tensors are still referenced."""
        if self._session is not None:
            raise ConfigError("a rollout session is open: end it before closing the switch")
        if self._s is None:
            return
        self._leave()
        self._s = None

    def __del__(self):
        # A switch dropped in rollout mode must not take offloaded training state with it:
        # bring it back (best effort: at interpreter exit torch may be gone already).
        try:
            if getattr(self, "_s", None) is not None and self._in_rollout and self._offloads:
                self._leave()
        except Exception as e:  # noqa: BLE001 (no exception may escape __del__)
            import warnings

            warnings.warn(f"lifecycle.Switch dropped in rollout mode: {e}", RuntimeWarning)

    def held(self) -> list[str]:
        """Names of handed-out rollout tensors still referenced."""
        return self._live().held()

    def stats(self) -> dict:
        """Counts and times of the switches so far (``enters``, ``refreshes``, ``exits``,
        ``reuses``, ``switch_seconds``, ``generation``)."""
        return dict(self._live().stats())

    @property
    def rollout_tp(self) -> int:
        return self._tp


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
            raise StaleWeightsError(
                f"the training weights changed during the session ({what}): "
                f"`{changed[0]}` and {len(changed) - 1} more were updated in place"
            )

    def handles(self, rank: int = 0, *, bits: bool = False) -> list:
        """The rollout tensors of local rank ``rank`` as handles (``_Tensor``): DLPack
        exporters that raise :class:`StaleWeightsError` once stale. ``bits`` exports them as
        unsigned integers of their width (what numpy can import)."""
        self._check("handles")
        return self._switch._s.tensors(rank, bits)

    def named_tensors(self, format: str = "hf", rank: int = 0) -> Iterator[tuple[str, Any]]:
        """``(name, tensor)`` for every rollout tensor of local rank ``rank``: torch tensors
        (DLPack views of the rollout buffer, zero-copy) on a torch switch, handles otherwise.

        ``format="hf"``: the rollout layout's names (Hugging Face's at any T).
        ``format="vllm"``: vLLM's runtime names and rank-local shapes (fused ``qkv_proj``,
        ``gate_up_proj``, FusedMoE ``w13_weight`` / ``w2_weight``, the vocabulary padded as
        vLLM pads it); fused tensors are new tensors (one copy), the others views."""
        self._check("named_tensors")
        if format not in ("hf", "vllm"):
            raise ConfigError(f'format `{format}`: expected "hf" or "vllm"')
        handles = self._switch._s.tensors(rank, False)
        if not self._switch._torch:
            if format == "vllm":
                raise ConfigError('format="vllm" yields torch tensors: it needs a torch switch')
            yield from ((h.name, h) for h in handles)
            return
        from ._torch import to_torch

        named = [(h.name, to_torch(h)) for h in handles]
        if format == "hf":
            yield from named
        else:
            yield from vllm_tensors(
                self._switch._config_json, dict(named), self._switch._tp, rank
            )

    def named_arrays(self, format: str = "hf", rank: int = 0) -> Iterator[tuple[str, Any]]:
        """``(name, numpy array)`` for every rollout tensor of local rank ``rank`` of a host
        switch: the bits of bf16 (``uint16``) and fp8 (``uint8``) tensors, zero-copy views in
        ``format="hf"``; ``format="vllm"`` as in :meth:`named_tensors` (fused arrays are
        copies). Concatenation moves bits unchanged, so the fused arrays are the exact bits."""
        self._check("named_arrays")
        if format not in ("hf", "vllm"):
            raise ConfigError(f'format `{format}`: expected "hf" or "vllm"')
        if self._switch._device != "cpu":
            raise ConfigError("named_arrays reads host memory: use named_tensors on a cuda switch")
        import numpy as np

        named = [(h.name, np.from_dlpack(h)) for h in self._switch._s.tensors(rank, True)]
        if format == "hf":
            yield from named
        else:
            yield from vllm_tensors(
                self._switch._config_json, dict(named), self._switch._tp, rank
            )

    @property
    def generation(self) -> int:
        """The generation of these weights (one more at every switch)."""
        return int(self._switch._s.stats()["generation"])
