"""PEFT's LoRA configuration as the switch takes it, and the adapters' names as PEFT writes
them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._lifecycle import ConfigError

# what PEFT's "all-linear" adapts on a Qwen decoder (every linear layer but the head)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# PEFT's state-dict keys: the model's names under its wrapper
PEFT_PREFIX = "base_model.model."


def lora_args(lora: Any) -> tuple[int, float, list[str], bool] | None:
    """``(r, lora_alpha, target_modules, use_rslora)`` of a PEFT ``LoraConfig`` or a dict with
    those keys (``use_rslora`` False where absent; ``target_modules`` a list of module names or
    ``"all-linear"``); None for None. Each field refused by name when it is of the wrong kind.

    >>> lora_args({"r": 8, "lora_alpha": 16, "target_modules": {"v_proj", "q_proj"}})
    (8, 16.0, ['q_proj', 'v_proj'], False)
    """
    if lora is None:
        return None
    if isinstance(lora, Mapping):
        get = lora.get
    else:

        def get(key: str, default: Any = None) -> Any:
            return getattr(lora, key, default)

    r, alpha = get("r"), get("lora_alpha")
    targets, rslora = get("target_modules"), get("use_rslora", False)
    if isinstance(r, bool) or not isinstance(r, int):
        raise ConfigError(f"lora: r: expected a positive integer, found {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ConfigError(f"lora: lora_alpha: expected a number, found {alpha!r}")
    if targets == "all-linear":
        targets = ALL_LINEAR
    if isinstance(targets, str) or not hasattr(targets, "__iter__"):
        raise ConfigError(
            f"lora: target_modules: expected module names (e.g. ['q_proj', 'v_proj']) or "
            f"'all-linear', found {targets!r}"
        )
    names = list(targets)
    if not all(isinstance(t, str) for t in names):
        raise ConfigError(f"lora: target_modules: expected strings, found {names!r}")
    return r, float(alpha), sorted(names), bool(rslora)


def is_adapter(name: str) -> bool:
    """Whether ``name`` is a LoRA matrix (``…lora_A.weight`` / ``…lora_B.weight``)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))
