#!/usr/bin/env python3
"""Writes the shared inputs of the verl-objective oracle (standard library only, deterministic).

    python3 scripts/oracles/verl_loss_inputs.py --out examples/tests/fixtures/verl_loss_inputs.json

The inputs: groups of rewards (one sequence per sample) and, per sequence, completion tokens with
(logp, old_logp, rollout_logp) triples. Every number is a multiple of 1/256 below 64 in magnitude,
so it is exact in float32 and float64 alike, and so are logp - old_logp and old_logp -
rollout_logp: the Rust test (float32) and the torch oracle (float64) start from the same numbers.
The log-ratios d = logp - old_logp are chosen away from the kinks of the objective (ln 0.8,
ln 1.28, ln 3, +-20) so that no token sits on a tie, and the rollout offsets
old_logp - rollout_logp away from ln C (C = tis_cap, the cap of truncated importance sampling).

The TIS members (`tis_cap`, `tis_cases` and each sequence's `rollout_logp`) were added after the
rest: without them the file is the one the first torch reference was made from, and the Rust
test compares the `verl` and `population` objectives on the inputs without them, so a reference
made before they existed still checks those two objectives.

The file this writes is committed; run this again only to change the cases (then run
scripts/oracles/verl_loss.py again on a machine with torch).
"""

import argparse
import json
import sys

# (old_logp, d): the token's log-probability under the sampling policy and its log-ratio
# d = logp - old_logp, with what it exercises (ratio rho = exp(d); the clip range is
# [0.8, 1.28], the dual clip's c is 3).
TOKENS = [
    (-2.5, 0.0, "rho = 1"),
    (-1.25, 0.09375, "inside the clip range, above 1"),
    (-3.0, -0.1875, "inside the clip range, below 1"),
    (-0.75, 0.296875, "just above 1 + eps_high"),
    (-4.0, -0.25, "just below 1 - eps_low"),
    (-1.5, 0.75, "between 1 + eps_high and c"),
    (-2.0, 1.0, "just below c = 3"),
    (-2.0, 1.125, "just above c = 3"),
    (-6.0, 2.0, "far above c"),
    (-3.5, -0.5, "below 1 - eps_low"),
    (-3.0, -3.0, "far below 1 - eps_low"),
    (-30.0, 25.0, "log-ratio beyond +20"),
    (-1.0, -23.5, "log-ratio beyond -20"),
    (-20.0, 19.5, "log-ratio just inside +20"),
    (-0.5, -20.25, "log-ratio just beyond -20"),
    (-45.0, 40.0, "log-ratio far beyond +20"),
    (-0.5, -19.75, "log-ratio just inside -20"),
]

# truncated importance sampling (verl's token-level TIS): the token's loss is multiplied by
# w = min(exp(old_logp - rollout_logp), C). Each case is (old_logp - rollout_logp, what w is);
# a token takes the cases in rotation, skipping one that would make rollout_logp positive.
TIS_CAP = 2.0
TIS_CASES = [
    (0.0, "w = 1: the rollout agrees with the trainer"),
    (0.25, "w between 1 and C"),
    (-0.5, "w below 1"),
    (0.625, "w just below C = 2"),
    (0.75, "w just above C: the cap binds"),
    (-0.125, "w just below 1"),
    (2.0, "w far above C"),
    (-3.0, "w far below 1"),
    (0.5, "w between 1 and C"),
    (6.0, "w = e^6, capped at C"),
    (-8.0, "w near 0"),
]

# rewards per group, with what the group exercises
GROUPS = [
    ([1.0, 0.0, 0.0, 1.0], "two of four rewarded"),
    ([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], "one of eight rewarded (the loop's group size)"),
    ([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0], "six of eight rewarded"),
    ([0.5, 0.5, 0.5], "all rewards equal: advantages 0"),
    ([0.75], "one sample: verl takes mean 0 and std 1"),
    ([0.25, 1.0, -0.5, 0.0, 0.5], "fractional and negative rewards"),
]


def rollout_offset(s, j, old):
    """old_logp - rollout_logp of token j of sequence s: TIS_CASES from (3 s + j) on, the first
    that keeps rollout_logp = old_logp - offset at most 0 (a log-probability)."""
    for k in range(len(TIS_CASES)):
        offset = TIS_CASES[(3 * s + j + k) % len(TIS_CASES)][0]
        if old - offset <= 0:
            return offset
    sys.exit(f"no TIS case keeps the rollout log-probability of {old} at most 0")


def sequences():
    """One sequence per sample of every group: a rotation of TOKENS, of length 5 to 17."""
    out = []
    s = 0
    for g, (rewards, _) in enumerate(GROUPS):
        for i in range(len(rewards)):
            length = 5 + (7 * s) % 13
            start = (5 * s) % len(TOKENS)
            picks = [TOKENS[(start + j) % len(TOKENS)] for j in range(length)]
            old_logp = [old for old, _, _ in picks]
            out.append(
                {
                    "group": g,
                    "sample": i,
                    "logp": [old + d for old, d, _ in picks],
                    "old_logp": old_logp,
                    "rollout_logp": [
                        old - rollout_offset(s, j, old) for j, old in enumerate(old_logp)
                    ],
                }
            )
            s += 1
    return out


def exact_f32(x):
    """Whether x is a multiple of 1/256 below 64 in magnitude (exact in float32)."""
    return abs(x) < 64 and float(x * 256).is_integer()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the inputs (JSON)")
    args = parser.parse_args()
    seqs = sequences()
    for s in seqs:
        for v in s["logp"] + s["old_logp"] + s["rollout_logp"]:
            if not exact_f32(v):
                sys.exit(f"{v} is not exact in float32")
    doc = {
        "about": "shared inputs of the verl-objective oracle: scripts/oracles/verl_loss.py "
        "(torch) and examples/tests/verl_objective.rs (Rust) read them",
        "made_by": "scripts/oracles/verl_loss_inputs.py",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "clip_ratio_c": 3.0,
        "adv_eps": 1e-6,
        "log_ratio_clamp": 20.0,
        "tis_cap": TIS_CAP,
        "token_cases": [{"old_logp": o, "log_ratio": d, "note": n} for o, d, n in TOKENS],
        "tis_cases": [{"old_minus_rollout": o, "note": n} for o, n in TIS_CASES],
        "groups": [{"rewards": r, "note": n} for r, n in GROUPS],
        "sequences": seqs,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    tokens = sum(len(s["logp"]) for s in seqs)
    print(f"wrote {args.out}: {len(GROUPS)} groups, {len(seqs)} sequences, {tokens} tokens")


if __name__ == "__main__":
    main()
