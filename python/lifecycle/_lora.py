"""PEFT's LoRA configuration as the switch takes it, and the adapters' names as PEFT writes
them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._lifecycle import ConfigError

# what PEFT's "all-linear" adapts on a Qwen decoder (every linear layer but the head)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# PEFT's state-dict keys: the model's names under its wrapper
PEFT_PREFIX = "base_model.model."


# PEFT's LoraConfig.bias: which biases train beside the adapters
BIAS = ("none", "all", "lora_only")


def lora_args(
    lora: Any, names: Iterable[str] | None = None
) -> tuple[int, float, list[str], bool, list[str]] | None:
    """``(r, lora_alpha, target_modules, use_rslora, trained)`` of a PEFT ``LoraConfig`` or a
    dict with those keys (``use_rslora`` False where absent; ``target_modules`` a list of module
    names or ``"all-linear"``); None for None. ``trained`` are the whole tensors trained beside
    the adapters, of the model's tensors ``names`` (none where ``names`` is None): the
    parameters of the modules ``modules_to_save`` names, and the biases ``bias`` trains
    (``"all"``: every bias, ``"lora_only"``: the adapted modules'; ``"none"`` by default)
    (:func:`trained_names`). Each field refused by name when it is of the wrong kind.

    >>> lora_args({"r": 8, "lora_alpha": 16, "target_modules": {"v_proj", "q_proj"}})
    (8, 16.0, ['q_proj', 'v_proj'], False, [])
    >>> names = ["lm_head.weight", "model.norm.weight"]
    >>> lora_args({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
    ...            "modules_to_save": ["lm_head"]}, names)[4]
    ['lm_head.weight']
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
    modules = list(targets)
    if not all(isinstance(t, str) for t in modules):
        raise ConfigError(f"lora: target_modules: expected strings, found {modules!r}")
    saved = get("modules_to_save", None)
    saved = [] if saved is None else saved
    if isinstance(saved, str) or not hasattr(saved, "__iter__"):
        raise ConfigError(
            f"lora: modules_to_save: expected module names (e.g. ['lm_head']), found {saved!r}"
        )
    saved = list(saved)
    if not all(isinstance(m, str) for m in saved):
        raise ConfigError(f"lora: modules_to_save: expected strings, found {saved!r}")
    bias = get("bias", "none")
    bias = "none" if bias is None else bias
    if bias not in BIAS:
        raise ConfigError(f"lora: bias: expected 'none', 'all' or 'lora_only', found {bias!r}")
    trained = [] if names is None else trained_names(names, saved, bias)
    return r, float(alpha), sorted(modules), bool(rslora), trained


def trained_names(names: Iterable[str], modules_to_save: Iterable[str], bias: str) -> list[str]:
    """The whole tensors of the model's tensors ``names`` trained beside the LoRA adapters: the
    parameters of every module ``modules_to_save`` names (PEFT's rule: the module's name, or
    its last parts, e.g. ``lm_head`` or ``embed_tokens``), and with ``bias="all"`` every bias,
    with ``bias="lora_only"`` the biases of the adapted modules. A module name that matches no
    module of the model is refused by name.

    >>> names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
    ...          "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
    ...          "model.layers.0.self_attn.q_proj.lora_A.weight", "lm_head.weight"]
    >>> trained_names(names, ["embed_tokens"], "lora_only")
    ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.bias']
    >>> len(trained_names(names, [], "all"))
    2
    """
    names = list(names)
    adapted = adapted_modules(names)
    names = [n for n in names if not is_adapter(n)]
    out: set[str] = set()
    for m in modules_to_save:
        hit = [n for n in names if _module_is(n.rpartition(".")[0], m)]
        if not hit:
            raise ConfigError(
                f"lora: modules_to_save: `{m}` names no module of the model (e.g. 'lm_head', "
                "'embed_tokens')"
            )
        out.update(hit)
    for n in names:
        module, _, last = n.rpartition(".")
        if last == "bias" and (bias == "all" or (bias == "lora_only" and module in adapted)):
            out.add(n)
    return sorted(out)


def _module_is(module: str, name: str) -> bool:
    """Whether ``module`` is the module PEFT's ``modules_to_save`` entry ``name`` names."""
    return module == name or module.endswith("." + name)


def adapted_modules(names: Iterable[str]) -> set[str]:
    """The modules with a LoRA adapter among the tensors ``names`` (``…q_proj`` of
    ``…q_proj.lora_A.weight``)."""
    suffix = ".lora_A.weight"
    return {n[: -len(suffix)] for n in names if n.endswith(suffix)}


def peft_key(name: str, adapted: set[str]) -> str:
    """PEFT's state-dict key of tensor ``name`` (what its saved adapter holds):
    ``base_model.model.`` + ``name``, a parameter of an adapted module (``adapted``,
    :func:`adapted_modules`) under its ``base_layer``.

    >>> peft_key("lm_head.weight", set())
    'base_model.model.lm_head.weight'
    >>> peft_key("model.layers.0.self_attn.q_proj.bias", {"model.layers.0.self_attn.q_proj"})
    'base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias'
    """
    module, _, last = name.rpartition(".")
    if not is_adapter(name) and module in adapted:
        return f"{PEFT_PREFIX}{module}.base_layer.{last}"
    return PEFT_PREFIX + name


def is_adapter(name: str) -> bool:
    """Whether ``name`` is a LoRA matrix (``…lora_A.weight`` / ``…lora_B.weight``)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def peft_name(name: str, adapter: str = "default") -> str | None:
    """A PEFT model's parameter ``name`` as the switch names it: PEFT's ``base_model.model.``
    dropped, a LoRA layer's ``base_layer`` folded into the layer, adapter ``adapter``'s matrices
    as ``lora_A.weight`` / ``lora_B.weight``, its ``modules_to_save`` copy of a module as the
    module's own tensor (the trained copy: ``lm_head.modules_to_save.default.weight`` is
    ``lm_head.weight``); None for PEFT's frozen original beside such a copy
    (``original_module``, unused while the adapter is active: not switched). Another
    adapter's matrices and copies, and adapters on a mixture-of-experts layer's experts, are
    refused by name.

    >>> peft_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> peft_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight")
    'model.layers.0.mlp.down_proj.lora_B.weight'
    >>> peft_name("base_model.model.lm_head.modules_to_save.default.weight")
    'lm_head.weight'
    >>> peft_name("base_model.model.lm_head.original_module.weight") is None
    True
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
    if ".original_module." in n:
        return None
    if ".modules_to_save." in n:
        head, tail = n.split(".modules_to_save.", 1)
        which, _, rest = tail.partition(".")
        if which != adapter or not rest:
            raise ConfigError(
                f"tensor `{name}`: a modules_to_save copy of adapter `{which}`; the switch "
                f"takes adapter `{adapter}` alone (set_adapter / adapter=...)"
            )
        return f"{head}.{rest}"
    return n
