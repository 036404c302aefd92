"""The project's GPU decoder as the rollout engine of a switch."""

from __future__ import annotations

from typing import Sequence


class Engine:
    """The project's GPU engine on a CUDA switch's rollout weights.

    It wakes with the rollout weights (KV room for ``max_sequences`` sequences of
    ``max_tokens`` positions each) and sleeps when the switch leaves rollout mode. With fp8
    rollout weights, ``fp8_compute`` chooses ``"weight-only"`` (the default: e4m3 weights
    against the activations in f32) or ``"w8a8"`` (activations quantised per token in 1 x 128
    groups; on the GPU a tensor-core kernel up to 8 sequences a step, cuBLASLt's block-scaled
    fp8 GEMM beyond). ``kv_dtype`` is the KV cache's element type:
    ``"bf16"`` (the default, as vLLM and SGLang keep it), ``"f32"`` (the decoder's exact
    mode, twice the bytes) or ``"fp8"`` (e4m3 with one f32 scale per position and kv head,
    about half bf16's bytes)::

        engine = Engine(switch, max_sequences=64, max_tokens=256)
        with switch.rollout() as w:
            samples = engine.generate(w, prompts, max_new_tokens=32)
    """

    def __init__(
        self,
        switch,
        *,
        max_sequences: int,
        max_tokens: int,
        fp8_compute: str = "weight-only",
        kv_dtype: str = "bf16",
    ):
        from .sources import _positive

        sequences = _positive("max_sequences", max_sequences, "sequences the KV cache holds")
        tokens = _positive("max_tokens", max_tokens, "positions of each sequence")
        # the switch checks every setting, and that it is a GPU switch, before it leaves
        # rollout mode (refused while handed-out tensors are referenced)
        switch._live().attach_engine(sequences, tokens, str(fp8_compute), str(kv_dtype))
        switch._in_rollout = False
        switch._may_have_moved = switch._offloads
        self._switch = switch

    def generate(
        self,
        weights,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        stop_token: int | None = None,
    ) -> list[list[int]]:
        """Tokens generated for each prompt on the session's weights (greedy at temperature 0;
        sequence ``i`` samples from a generator keyed by ``(seed, i)``)."""
        if weights._switch is not self._switch:
            from ._lifecycle import ConfigError

            raise ConfigError(
                "these rollout weights belong to another switch than the engine's: pass the "
                "session of the switch the engine was built on"
            )
        weights._check("engine.generate")
        return self._switch._live().generate(
            [list(map(int, p)) for p in prompts],
            int(max_new_tokens),
            float(temperature),
            int(seed),
            stop_token,
        )
