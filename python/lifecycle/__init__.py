"""Borrow-checked weight switching for colocated RL training, from PyTorch.

A :class:`Switch` is built over the training parameters a trainer owns (PyTorch FSDP2 shards
on the GPU, lent by address; host arrays on the CPU reference backend). ``with
switch.rollout() as w:`` enters rollout mode only when the weights changed since the last
enter (torch's own in-place version counters tell), and ``w.named_tensors()`` yields the
rollout weights as DLPack views. A rollout tensor used after its session ended or after the
weights changed raises :class:`StaleWeightsError`; rollout weights are never rewritten or freed
while a tensor handed out from them is still referenced (:class:`TensorsInUseError`).
"""

from ._lifecycle import (
    BackendError,
    ConfigError,
    LifecycleError,
    StaleWeightsError,
    TensorMismatchError,
    TensorsInUseError,
    expected_parameters,
)
from .engine import Engine
from .switch import RolloutWeights, Switch
from .vllm import vllm_names

__all__ = [
    "BackendError",
    "ConfigError",
    "Engine",
    "LifecycleError",
    "RolloutWeights",
    "StaleWeightsError",
    "Switch",
    "TensorMismatchError",
    "TensorsInUseError",
    "expected_parameters",
    "vllm_names",
]
