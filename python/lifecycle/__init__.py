"""Borrow-checked weight switching for colocated RL training, from PyTorch.

A :class:`Switch` is built over the training parameters a trainer owns (PyTorch FSDP2 shards
on the GPU, lent by address; host arrays on the CPU reference backend). ``with
switch.rollout() as w:`` enters rollout mode only when the weights changed since the last
enter (torch's own in-place version counters tell), and ``w.named_tensors()`` yields the
rollout weights as DLPack views. A rollout tensor used after its session ended or after the
weights changed raises :class:`StaleWeightsError`; rollout weights are never rewritten or freed
while a tensor handed out from them is still referenced (:class:`TensorsInUseError`).
"""

import atexit as _atexit

from ._lifecycle import (
    BackendError,
    ConfigError,
    LifecycleError,
    NonFiniteError,
    StaleWeightsError,
    TensorMismatchError,
    TensorsInUseError,
    __version__,
)
from ._lifecycle import _finalizing
from .engine import Engine, Filled, GroupStream, Sample
from .switch import Masters, RolloutWeights, Switch, expected_parameters
from .vllm import vllm_names
from ._megatron import megatron_parameters

# From the interpreter's exit on, memory still referenced by handed-out tensors is left to the
# process's end (the CUDA driver may be gone before the last of them is collected).
_atexit.register(_finalizing)

__all__ = [
    "BackendError",
    "ConfigError",
    "Engine",
    "Filled",
    "GroupStream",
    "LifecycleError",
    "Masters",
    "NonFiniteError",
    "RolloutWeights",
    "Sample",
    "StaleWeightsError",
    "Switch",
    "TensorMismatchError",
    "TensorsInUseError",
    "__version__",
    "expected_parameters",
    "megatron_parameters",
    "vllm_names",
]
