"""The trainer's tensors as a switch holds them: name, full shape, the shards this process lends,
and the object whose in-place version counter says they changed."""

from __future__ import annotations

from typing import Any, Sequence

from ._lifecycle import TensorMismatchError


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _address(name: str, x: Any, device: str) -> tuple[int, int]:
    """``(address, elements)`` of a contiguous fp32 array or tensor, checked by name."""
    if _is_torch(x):
        import torch

        if x.dtype != torch.float32:
            raise TensorMismatchError(
                f"tensor `{name}`: fp32 training weights expected, found {x.dtype}"
            )
        if not x.is_contiguous():
            raise TensorMismatchError(f"tensor `{name}`: its shard is not contiguous")
        found = "cuda" if x.is_cuda else "cpu"
        if found != device:
            raise TensorMismatchError(
                f"tensor `{name}`: on {x.device}, this switch runs on {device}"
            )
        return (x.data_ptr() if x.numel() else 0, x.numel())
    iface = getattr(x, "__array_interface__", None)
    if iface is None:
        raise TensorMismatchError(
            f"tensor `{name}`: a torch tensor or a numpy array expected, found {type(x).__name__}"
        )
    if device != "cpu":
        raise TensorMismatchError(f"tensor `{name}`: a host array given to a {device} switch")
    if iface["typestr"] != "<f4":
        raise TensorMismatchError(
            f"tensor `{name}`: fp32 training weights expected, found dtype {x.dtype}"
        )
    if not x.flags["C_CONTIGUOUS"]:
        raise TensorMismatchError(f"tensor `{name}`: its shard is not C-contiguous")
    return (iface["data"][0] if x.size else 0, int(x.size))


def _chunks(n: int, world: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 chunks: ``ceil(n / world)`` rows each, short or empty trailing ranks."""
    per = -(-n // world)
    return [(min(r * per, n), min((r + 1) * per, n)) for r in range(world)]


class _Source:
    """One training tensor: its name, full shape, the shards this process lends (one per
    local rank) and the object whose in-place version counter says it changed."""

    def __init__(self, name: str, shape: Sequence[int], shards: list[Any], versioned: Any):
        self.name = name
        self.shape = [int(d) for d in shape]
        self.shards = shards
        self.versioned = versioned
        self._checked: list[bool] = [False] * len(shards)
        self._numel: list[int] = [0] * len(shards)
        self._torch: list[bool] = [False] * len(shards)

    def version(self) -> Any:
        """The in-place version counters of the parameter and of its local tensor: an
        optimizer step moves the first (``AdamW.step()`` on an FSDP2 parameter) or, through
        ``DTensor`` dispatch of foreach kernels, only the second."""
        v = self.versioned
        local = getattr(v, "_local_tensor", None)
        return (getattr(v, "_version", None), getattr(local, "_version", None))

    def address(self, i: int, device: str) -> tuple[int, int]:
        """Shard ``i``'s ``(address, elements)``; dtype, layout and device are checked the
        first time (they do not change under a trainer), the address every time (a restored
        storage moves)."""
        x = self.shards[i]
        if not self._checked[i]:
            addr = _address(self.name, x, device)
            self._checked[i] = True
            self._numel[i] = addr[1]
            self._torch[i] = _is_torch(x)
            return addr
        if self._torch[i]:
            n = self._numel[i]
            return (x.data_ptr() if n else 0, n)
        return _address(self.name, x, device)
