"""The trainer's tensors as a switch holds them: name, full shape, the shards this process lends,
and what says they changed (torch's in-place version counters, or the switch's own count of
writes through :meth:`lifecycle.Switch.update` for numpy arrays)."""

from __future__ import annotations

from typing import Any, Sequence

from ._lifecycle import ConfigError, TensorMismatchError


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _is_numpy(x: Any) -> bool:
    return type(x).__module__.startswith("numpy") and hasattr(x, "__array_interface__")


def _positive(what: str, value: Any, meaning: str) -> int:
    """``value`` as an int of at least 1, or a ConfigError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise ConfigError(
            f"{what}: expected a positive integer ({meaning}), found {type(value).__name__} "
            f"{value!r}"
        )
    n = int(value.__index__())
    if n < 1:
        raise ConfigError(f"{what}: expected a positive integer ({meaning}), found {n}")
    return n


def _check_array(name: str, x: Any, device: str) -> None:
    """A torch tensor or numpy array of fp32, contiguous, on ``device``; else an error naming
    the tensor and the fix."""
    if _is_torch(x):
        import torch

        if not isinstance(x, torch.Tensor):
            raise TensorMismatchError(
                f"tensor `{name}`: a torch tensor or a numpy array expected, found "
                f"{type(x).__name__}"
            )
        if x.dtype != torch.float32:
            raise TensorMismatchError(
                f"tensor `{name}`: fp32 training weights expected, found {x.dtype}: keep fp32 "
                "masters (pass t.float())"
            )
        if not x.is_contiguous():
            raise TensorMismatchError(
                f"tensor `{name}`: its shard is not contiguous: pass t.contiguous()"
            )
        found = "cuda" if x.is_cuda else "cpu"
        if found != device:
            raise TensorMismatchError(
                f"tensor `{name}`: on {x.device}, and this switch runs on {device}: give every "
                f"tensor on {device}"
            )
        return
    if not _is_numpy(x):
        raise TensorMismatchError(
            f"tensor `{name}`: a numpy array or a torch tensor expected, found "
            f"{type(x).__name__}: pass np.asarray(x, dtype=np.float32)"
        )
    if device != "cpu":
        raise TensorMismatchError(
            f"tensor `{name}`: a host array given to a {device} switch: give torch tensors on "
            f"{device}"
        )
    if x.__array_interface__["typestr"] != "<f4":
        raise TensorMismatchError(
            f"tensor `{name}`: fp32 training weights expected, found dtype {x.dtype}: pass "
            "a.astype(np.float32)"
        )
    if not x.flags["C_CONTIGUOUS"]:
        raise TensorMismatchError(
            f"tensor `{name}`: its shard is not C-contiguous: pass np.ascontiguousarray(a)"
        )


def _address(x: Any) -> tuple[int, int]:
    """``(address, elements)`` of a checked array or tensor."""
    if _is_torch(x):
        return (x.data_ptr() if x.numel() else 0, x.numel())
    return (x.__array_interface__["data"][0] if x.size else 0, int(x.size))


def _chunks(n: int, world: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks: ``ceil(n / world)`` rows each, short or empty trailing ranks."""
    per = -(-n // world)
    return [(min(r * per, n), min((r + 1) * per, n)) for r in range(world)]


def _set_writeable(arrays: list[Any], on: bool) -> None:
    for a in arrays:
        if _is_numpy(a):
            a.flags.writeable = on


def _at(a: Any) -> int:
    return a.__array_interface__["data"][0]


class _HostArrays:
    """The numpy arrays switches hold, by address (shared by every switch of the process): how
    many switches hold each (held arrays are read-only, and writable again when the last lets
    go) and how often each was written through a switch, whichever switch it was (what says it
    changed: numpy keeps no version counter)."""

    # by the array object (the flag is the object's), and by address (the memory's writes)
    holders: dict[int, int] = {}
    writes: dict[int, int] = {}

    @classmethod
    def check_writable(cls, name: str, arrays: list[Any]) -> None:
        """Each array is held by a switch already, or numpy can make it read-only and writable
        again: the switch holds it read-only and the trainer writes it through
        :meth:`lifecycle.Switch.update`. numpy cannot for memory it does not own (a view of
        ``torch.Tensor.numpy()``, ``np.frombuffer`` of bytes)."""
        for a in arrays:
            if cls.holders.get(id(a), 0) > 0:
                continue
            was = a.flags.writeable
            try:
                a.flags.writeable = False
                a.flags.writeable = True
            except ValueError:
                raise TensorMismatchError(
                    f"tensor `{name}`: numpy cannot make this array writable again once the "
                    "switch holds it read-only (it views memory numpy does not own, e.g. "
                    "torch.Tensor.numpy() or np.frombuffer): pass a.copy(), or the torch "
                    "tensor itself"
                ) from None
            a.flags.writeable = was

    @classmethod
    def take(cls, arrays: list[Any]) -> None:
        for a in arrays:
            cls.holders[id(a)] = cls.holders.get(id(a), 0) + 1
        _set_writeable(arrays, False)

    @classmethod
    def give_back(cls, arrays: list[Any]) -> None:
        free = []
        for a in arrays:
            n = cls.holders.get(id(a), 0) - 1
            if n > 0:
                cls.holders[id(a)] = n
            else:
                cls.holders.pop(id(a), None)
                free.append(a)
        _set_writeable(free, True)

    @classmethod
    def wrote(cls, arrays: list[Any]) -> None:
        for a in arrays:
            cls.writes[_at(a)] = cls.writes.get(_at(a), 0) + 1

    @classmethod
    def version(cls, arrays: list[Any]) -> tuple:
        return tuple(cls.writes.get(_at(a), 0) for a in arrays)


class _Source:
    """One training tensor: its name, full shape, the shards this process lends (one per local
    rank), what a trainer writes through (``given``: the full array, or the list of shards) and
    what says it changed."""

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        shards: list[Any],
        versioned: Any = None,
        given: Any = None,
    ):
        self.name = name
        self.shape = [int(d) for d in shape]
        self.shards = shards
        self.versioned = versioned
        self.given = given
        self._numel: list[int] = [0] * len(shards)

    def version(self) -> Any:
        """What moves when the tensor changes: the count of writes through a switch into its
        numpy arrays, and the in-place version counters of the parameter, of its local tensor
        and of every shard (an optimizer step moves the first, ``AdamW.step()`` on an FSDP2
        parameter, or through ``DTensor`` dispatch of foreach kernels only the second)."""
        v = self.versioned
        local = getattr(v, "_local_tensor", None)
        return (
            _HostArrays.version(self.host_arrays()),
            getattr(v, "_version", None),
            getattr(local, "_version", None),
            tuple(getattr(s, "_version", None) for s in self.shards),
        )

    def check(self, device: str) -> None:
        """Checks every shard's dtype, layout and device (they do not change under a trainer),
        and that the numpy arrays given can be written through the switch."""
        for i, x in enumerate(self.shards):
            _check_array(self.name, x, device)
            self._numel[i] = _address(x)[1]
        _HostArrays.check_writable(self.name, self.host_arrays())

    def address(self, i: int) -> tuple[int, int]:
        """Shard ``i``'s ``(address, elements)`` now (a restored storage moves)."""
        x = self.shards[i]
        n = self._numel[i]
        if _is_torch(x):
            return (x.data_ptr() if n else 0, n)
        return (x.__array_interface__["data"][0] if n else 0, n)

    def host_arrays(self) -> list[Any]:
        """The numpy arrays the trainer gave (the full array, or every rank's shard): what the
        switch makes read-only and counts writes to (the shards cut from a full array are the
        switch's own views)."""
        given = self.given if isinstance(self.given, list) else [self.given]
        seen, out = set(), []
        for a in given:
            if _is_numpy(a) and id(a) not in seen:
                seen.add(id(a))
                out.append(a)
        return out

    def write(self, value: Any) -> None:
        """Writes ``value`` (the full tensor; for a source built from shards, also the list of
        every rank's shard) into the arrays the switch lends, in place."""
        import numpy as np

        targets: list[tuple[Any, Any]]
        if isinstance(value, (list, tuple)) and isinstance(self.given, list):
            if len(value) != len(self.given):
                raise TensorMismatchError(
                    f"tensor `{self.name}`: {len(value)} shards written, the switch holds "
                    f"{len(self.given)} (one per rank)"
                )
            targets = list(zip(self.given, value))
        elif isinstance(self.given, list):
            full = value
            shape = list(getattr(full, "shape", np.shape(full)))
            if shape != self.shape:
                raise TensorMismatchError(
                    f"tensor `{self.name}`: shape {shape} written, its shape is {self.shape}"
                )
            rows = _chunks(self.shape[0] if self.shape else 0, len(self.given))
            targets = [(g, full[lo:hi]) for g, (lo, hi) in zip(self.given, rows)]
        else:
            targets = [(self.given, value)]
        for dst, src in targets:
            if _is_torch(dst):
                import torch

                src = torch.as_tensor(src, dtype=dst.dtype, device=dst.device)
                if list(src.shape) != list(dst.shape):
                    raise TensorMismatchError(
                        f"tensor `{self.name}`: shape {list(src.shape)} written, its shape is "
                        f"{list(dst.shape)}"
                    )
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
                continue
            src = np.asarray(src)
            if list(src.shape) != list(dst.shape):
                raise TensorMismatchError(
                    f"tensor `{self.name}`: shape {list(src.shape)} written, its shape is "
                    f"{list(dst.shape)}"
                )
            if not np.issubdtype(src.dtype, np.floating):
                raise TensorMismatchError(
                    f"tensor `{self.name}`: floating-point values expected, found {src.dtype}"
                )
            if not np.shares_memory(src, dst) or src.ctypes.data != dst.ctypes.data:
                np.copyto(dst, src, casting="same_kind")
        self.wrote()

    def wrote(self) -> None:
        """Marks the tensor written (every switch over its arrays sees it changed)."""
        _HostArrays.wrote(self.host_arrays())
