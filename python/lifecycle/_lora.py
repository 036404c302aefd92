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


def peft_name(name: str, adapter: str = "default") -> str:
    """A PEFT model's parameter ``name`` as the switch names it: PEFT's ``base_model.model.``
    dropped, a LoRA layer's ``base_layer`` folded into the layer, adapter ``adapter``'s matrices
    as ``lora_A.weight`` / ``lora_B.weight``. Another adapter's matrices and PEFT's
    ``modules_to_save`` copies and adapters on a mixture-of-experts layer's experts are
    refused by name.

    >>> peft_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> peft_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight")
    'model.layers.0.mlp.down_proj.lora_B.weight'
    """
    n = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
    n = n.replace(".base_layer.", ".")
    for part in ("lora_A", "lora_B"):
        marker = f".{part}."
        if marker in n:
            head, tail = n.split(marker, 1)
            if head.endswith(".experts") or ".experts." in head:
                raise ConfigError(
                    f"tensor `{name}`: a LoRA matrix on the experts of a mixture-of-experts "
                    "layer, which the switch does not adapt yet: target the attention (q_proj, "
                    "k_proj, v_proj, o_proj) and dense MLP layers"
                )
            if tail != f"{adapter}.weight":
                raise ConfigError(
                    f"tensor `{name}`: a LoRA matrix of adapter `{tail.split('.')[0]}`; the "
                    f"switch takes adapter `{adapter}` alone (set_adapter / adapter=...)"
                )
            return f"{head}.{part}.weight"
    if ".modules_to_save." in n or ".original_module." in n:
        raise ConfigError(
            f"tensor `{name}`: PEFT's modules_to_save are not switched yet: train without "
            "modules_to_save"
        )
    return n
