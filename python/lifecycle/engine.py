"""The project's GPU decoder as the rollout engine of a switch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np


class Engine:
    """The project's GPU engine on a CUDA switch's rollout weights.

    It wakes with the rollout weights and sleeps when the switch leaves rollout mode. Up to
    ``max_sequences`` sequences of up to ``max_tokens`` positions each run at once in a KV
    cache of ``kv_tokens`` positions (by default all of them at their longest), kept in pages
    of 64 positions: a request holds the pages of its own prompt and ``max_new_tokens``,
    reserved when it is admitted (a request waits until they are free; one that could never
    fit is refused), and a group's samples admitted together share their prompt's full pages.
    So a cache smaller than ``max_sequences × max_tokens`` serves many short requests and a
    few long ones. With fp8
    rollout weights, ``fp8_compute`` chooses ``"w8a8"`` (the default and the fast mode, as vLLM
    and verl run block fp8: activations quantised per token in 1 x 128 groups; on the GPU a
    tensor-core kernel up to 64 sequences a step, cuBLASLt's block-scaled fp8 GEMM beyond) or
    ``"weight-only"`` (the exact mode: e4m3 weights against the activations in f32). ``kv_dtype`` is the KV cache's element type:
    ``"bf16"`` (the default, as vLLM and SGLang keep it), ``"f32"`` (the decoder's exact
    mode, twice the bytes) or ``"fp8"`` (e4m3 with one f32 scale per position and kv head,
    about half bf16's bytes). Over a LoRA switch (:meth:`Switch.from_peft`), ``lora_mode``
    chooses ``"unmerged"`` (the default: each adapter's branch beside its base product, the
    base read where the switch holds it) or ``"merged"`` (a private bf16 copy of the rollout
    weights with ``W + s·B·A`` in each adapted matrix, made whenever the engine wakes on new
    weights: the products of a model without adapters, for a second copy of the weights)::

        engine = Engine(switch, max_sequences=64, max_tokens=256)
        with switch.rollout() as w:
            samples = engine.generate(w, prompts, max_new_tokens=32, temperature=1.0,
                                      top_p=0.95, stop_tokens=[eos])
        tokens, logprobs = samples[0].tokens, samples[0].logprobs  # a list, a float32 array
    """

    def __init__(
        self,
        switch,
        *,
        max_sequences: int,
        max_tokens: int,
        fp8_compute: Literal["w8a8", "weight-only"] = "w8a8",
        kv_dtype: Literal["bf16", "f32", "fp8"] = "bf16",
        kv_tokens: int | None = None,
        lora_mode: Literal["unmerged", "merged"] = "unmerged",
    ):
        from .sources import _positive

        sequences = _positive("max_sequences", max_sequences, "sequences the KV cache holds")
        tokens = _positive("max_tokens", max_tokens, "positions of each sequence")
        if kv_tokens is not None:
            kv_tokens = _positive("kv_tokens", kv_tokens, "positions of the KV cache")
        # the switch checks every setting, and that it is a GPU switch, before it leaves
        # rollout mode (refused while handed-out tensors are referenced)
        switch._live().attach_engine(
            sequences, tokens, str(fp8_compute), str(kv_dtype), kv_tokens, str(lora_mode)
        )
        switch._in_rollout = False
        switch._may_have_moved = switch._offloads
        self._switch = switch

    def generate(
        self,
        weights,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop_tokens: Sequence[int] = (),
        seed: int | Sequence[int] = 0,
    ) -> list[Sample]:
        """One :class:`Sample` per prompt, generated on the session's weights with continuous
        batching: the prompts queue, each holds one of the engine's ``max_sequences`` KV slots
        while it runs, and a finished sample's slot goes to the next prompt at once.

        A token is drawn from ``softmax(logits / temperature)`` (greedy at 0) restricted to the
        ``top_k`` most likely tokens, then to the smallest set of those whose mass reaches
        ``top_p``; a sample ends at any of ``stop_tokens`` (kept as its last token) or after
        ``max_new_tokens`` (one for all, or one per prompt). ``seed`` is one per prompt, or one
        for all (prompt ``i`` then draws from ``seed_of(seed, i)``); a prompt's draws are its
        own, so its tokens depend on the others sharing its steps only through the logits (equal
        given equal logits). Settings out of range are refused naming the request and the field,
        before anything runs."""
        _same_switch(self, weights, "engine.generate")
        prompts = [_tokens(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
        n = len(prompts)
        lengths = _per_prompt("max_new_tokens", max_new_tokens, n)
        live = self._switch._live()
        if isinstance(seed, Sequence):
            seeds = _per_prompt("seed", seed, n)
        else:
            one = _per_prompt("seed", seed, 1)[0]
            seeds = [live.seed_of(one, i) for i in range(n)]
        out = live.run(
            prompts,
            lengths,
            _number("temperature", temperature),
            _number("top_p", top_p),
            None if top_k is None else _per_prompt("top_k", top_k, 1)[0],
            _tokens("stop_tokens", stop_tokens),
            seeds,
        )
        return [_sample(t) for t in out]


def _sample(t) -> Sample:
    tokens, lp, raw, trunc, finish, versions = t
    return Sample(
        tokens=tokens,
        logprobs=np.asarray(lp, dtype=np.float32),
        raw_logprobs=np.asarray(raw, dtype=np.float32),
        truncated_logprobs=np.asarray(trunc, dtype=np.float32),
        finish_reason=finish,
        versions=versions,
    )


def _same_switch(engine: Engine, weights, what: str) -> None:
    if weights._switch is not engine._switch:
        from ._lifecycle import ConfigError

        raise ConfigError(
            "these rollout weights belong to another switch than the engine's: pass the "
            "session of the switch the engine was built on"
        )
    weights._check(what)


class GroupStream:
    """DAPO's dynamic sampling, streamed, on an :class:`Engine`.

    Prompt groups (``group_size`` samples of one prompt each, sampled with the settings given
    here) are submitted as the engine's slots free up instead of in whole generation batches;
    a group is scored as soon as its last sample finishes, and :meth:`fill` returns once
    ``want`` groups are kept. The requests still in flight are then aborted (``leftovers=
    "abort"``: their KV freed at once), or carried as partial rollouts (``"partial"``): they
    continue at the next fill on the weights of then, each token's weight version recorded in
    :attr:`Sample.versions`, and a sample more than ``max_staleness`` versions old (default 1)
    is dropped (counted in ``stale``), never trained on. ``max_groups`` bounds the new groups a
    fill submits: once they are all submitted and finished it returns what it kept, fewer than
    ``want`` (without it, a fill whose groups are never kept runs forever).

    Aborting favours short samples: the groups that finish first are the ones kept, so kept
    samples are shorter on average than those generated (``Filled.kept_mean_len`` against
    ``finished_mean_len``); partial rollouts avoid the bias::

        stream = GroupStream(engine, 16, max_new_tokens=512, temperature=1.0,
                             leftovers="partial")
        with switch.rollout() as w:
            filled = stream.fill(w, 8, group=lambda g: prompts[g],
                                 keep=lambda g, samples: len({reward(s) for s in samples}) > 1)
    """

    def __init__(
        self,
        engine: Engine,
        group_size: int,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop_tokens: Sequence[int] = (),
        seed: int = 0,
        leftovers: Literal["abort", "partial"] = "abort",
        max_staleness: int | None = None,
        max_groups: int | None = None,
    ):
        from ._lifecycle import _GroupStream

        self._engine = engine
        self._stream = _GroupStream(
            _per_prompt("group_size", group_size, 1)[0],
            _per_prompt("max_new_tokens", max_new_tokens, 1)[0],
            _number("temperature", temperature),
            _number("top_p", top_p),
            None if top_k is None else _per_prompt("top_k", top_k, 1)[0],
            _tokens("stop_tokens", stop_tokens),
            _per_prompt("seed", seed, 1)[0],
            str(leftovers),
            None if max_staleness is None else _per_prompt("max_staleness", max_staleness, 1)[0],
            None if max_groups is None else _per_prompt("max_groups", max_groups, 1)[0],
        )

    def fill(self, weights, want: int, *, group, keep) -> Filled:
        """Generates until ``want`` groups are kept: ``group(g)`` gives group ``g``'s prompt
        (groups are numbered from 0 over the stream's life), ``keep(g, samples)`` scores a
        finished group. The callbacks must not call the switch (it is busy running them); an
        exception in one ends the fill, every request in flight aborted, and is raised here."""
        _same_switch(self._engine, weights, "stream.fill")
        want = _per_prompt("want", want, 1)[0]
        kept, counts = self._engine._switch._live().fill(
            self._stream,
            want,
            lambda g: _tokens(f"group({g})", group(g)),
            lambda g, tuples: bool(keep(g, [_sample(t) for t in tuples])),
        )
        return Filled(kept=[(g, [_sample(t) for t in ts]) for g, ts in kept], **counts)


@dataclass(frozen=True)
class Filled:
    """One :meth:`GroupStream.fill`: the kept groups (their ids and samples, in the order they
    were kept) and what the fill cost."""

    kept: list[tuple[int, list[Sample]]]
    dropped_groups: int
    finished: int
    finished_tokens: int
    aborted: int
    aborted_tokens: int
    carried: int
    stale: int
    steps: int
    kept_mean_len: float
    finished_mean_len: float


@dataclass(frozen=True)
class Sample:
    """What one prompt gave back.

    ``logprobs[k]`` is token ``k``'s ``log_softmax(logits / temperature)`` before top-k / top-p
    truncation (what a trainer recomputes for the importance ratio; of the logits at
    temperature 0), ``raw_logprobs`` at temperature 1, ``truncated_logprobs`` in the truncated,
    renormalised distribution the token was drawn from (0 when greedy); ``finish_reason`` is
    ``"stop"`` (its last token is a stop token), ``"length"`` (``max_new_tokens`` reached) or
    ``"abort"``; ``versions[k]`` is the weight version token ``k`` was sampled on (a partial
    rollout of a :class:`GroupStream` spans several)."""

    tokens: list[int]
    logprobs: np.ndarray
    raw_logprobs: np.ndarray
    truncated_logprobs: np.ndarray
    finish_reason: Literal["stop", "length", "abort"]
    versions: list[int] = field(default_factory=list)


def _count(what: str, value: Any) -> int:
    """``value`` as an int of at least 0, or a ConfigError naming ``what``."""
    from ._lifecycle import ConfigError

    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ConfigError(
            f"{what}: expected a non-negative integer, found {type(value).__name__} {value!r}"
        )
    n = int(value.__index__())
    if n < 0:
        raise ConfigError(f"{what}: expected a non-negative integer, found {n}")
    return n


def _per_prompt(what: str, value: Any, n: int) -> list[int]:
    """One non-negative int for all ``n`` prompts, or a sequence of ``n``."""
    from ._lifecycle import ConfigError

    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ConfigError(f"{what}: expected one value or {n} (one per prompt), found {len(value)}")
        return [_count(f"{what}[{i}]", v) for i, v in enumerate(value)]
    return [_count(what, value)] * n


def _tokens(what: str, value: Any) -> list[int]:
    """A sequence of token ids."""
    from ._lifecycle import ConfigError

    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{what}: expected a sequence of token ids, found {type(value).__name__}")
    return [_count(f"{what}[{i}]", t) for i, t in enumerate(value)]


def _number(what: str, value: Any) -> float:
    """A real number (its range is checked with the request)."""
    from ._lifecycle import ConfigError

    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError(f"{what}: expected a number, found {type(value).__name__} {value!r}")
    return float(value)
