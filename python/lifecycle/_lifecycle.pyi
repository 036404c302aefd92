"""Type stubs of the extension (`lifecycle._lifecycle`); the public front is `lifecycle`."""

from typing import Any, Callable, Optional

class LifecycleError(Exception): ...
class ConfigError(LifecycleError): ...
class TensorMismatchError(LifecycleError): ...
class StaleWeightsError(LifecycleError): ...
class TensorsInUseError(LifecycleError): ...
class NonFiniteError(LifecycleError): ...
class BackendError(LifecycleError): ...

__version__: str

def expected_parameters(
    config_json: str, lora: tuple[int, float, list[str], bool, list[str]] | None = None
) -> list[tuple[str, list[int]]]: ...
def vllm_names(
    config_json: str, tp: int, experts: str, dtype: str
) -> list[tuple[str, list[int]]]: ...
def megatron_parameters(
    config_json: str,
    tp: int,
    pp: int,
    dp: int,
    padded_vocab: int | None = None,
    rank: int = 0,
    ep: int = 1,
    etp: int | None = None,
) -> list[tuple[str, list[int]]]: ...
def _finalizing() -> None: ...

class _Tensor:
    """One rollout tensor handed out through DLPack (see `RolloutWeights.handles`)."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def dtype_name(self) -> str: ...
    def check_current(self) -> None: ...
    def bits(self) -> "_Tensor": ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...

_Offload = tuple[str, str, int, int, Callable[[int, int], None], Callable[[int, int], int]]

class _GroupStream:
    def __init__(
        self,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: Optional[int],
        stop_tokens: list[int],
        seed: int,
        leftovers: str,
        max_staleness: Optional[int],
        max_groups: Optional[int],
    ) -> None: ...

class _Switch:
    def __init__(
        self,
        config_json: str,
        names: list[tuple[str, list[int]]],
        *,
        world: int,
        tp: int,
        dtype_name: str,
        experts_name: str,
        offload: str,
        switching: str,
        device: str,
        gpu: int = 0,
        fp8_keep: str = "none",
        lora: tuple[int, float, list[str], bool, list[str]] | None = None,
        shared: list[tuple[str, list[int], int]] | None = None,
    ) -> None: ...
    @staticmethod
    def megatron(
        config_json: str,
        *,
        tp: int,
        pp: int,
        dp: int,
        padded_vocab: int,
        rollout_tp: int,
        dtype_name: str,
        experts_name: str,
        offload: str,
        switching: str,
        gpu: int = 0,
        fp8_keep: str = "none",
        ranks: str = "process",
        ep: int = 1,
        etp: int | None = None,
    ) -> _Switch: ...
    def parameters(self, local: int = 0) -> list[tuple[str, list[int]]]: ...
    def check_shards(self, shards: list[list[tuple[int, int]]]) -> None: ...
    def enter(
        self,
        shards: list[list[tuple[int, int]]],
        versions: list[int],
        refresh: bool,
        stream: Optional[int] = None,
        offload: Optional[list[list[_Offload]]] = None,
    ) -> tuple[bool, int, float]: ...
    def check_shared(self, versions: list[int], addresses: list[int]) -> None: ...
    def reuse(
        self, versions: list[int], refresh: bool, may_have_moved: bool
    ) -> Optional[tuple[bool, int, float]]: ...
    def changed(self, versions: list[int], refresh: bool) -> bool: ...
    def open_session(self) -> int: ...
    def close_session(self) -> None: ...
    def tensors(self, local: int = 0, bits: bool = False) -> list[_Tensor]: ...
    def exit(self) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def held(self) -> list[str]: ...
    def stats(self) -> dict[str, Any]: ...
    def local_ranks(self) -> list[int]: ...
    def attach_engine(
        self,
        max_sequences: int,
        max_tokens: int,
        fp8_compute: str = "w8a8",
        kv_dtype: str = "bf16",
        kv_tokens: Optional[int] = None,
        lora_mode: str = "unmerged",
    ) -> None: ...
    def run(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        temperature: float,
        top_p: float,
        top_k: Optional[int],
        stop_tokens: list[int],
        seeds: list[int],
    ) -> list[tuple[list[int], list[float], list[float], list[float], str, list[int]]]: ...
    def fill(
        self,
        stream: _GroupStream,
        want: int,
        group: Callable[[int], list[int]],
        keep: Callable[[int, list[tuple[list[int], list[float], list[float], list[float], str, list[int]]]], bool],
    ) -> tuple[list[tuple[int, list[tuple[list[int], list[float], list[float], list[float], str, list[int]]]]], dict[str, Any]]: ...
    @staticmethod
    def seed_of(seed: int, index: int) -> int: ...
