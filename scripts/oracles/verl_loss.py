#!/usr/bin/env python3
"""The verl-objective oracle: verl's GRPO advantages and vanilla token-mean policy loss in torch.

    python3 scripts/oracles/verl_loss.py \\
        --inputs examples/tests/fixtures/verl_loss_inputs.json \\
        --out examples/tests/fixtures/verl_loss_torch.json

Needs torch only (any version with torch.maximum, 1.7 or later); runs on the CPU in float64.
For each objective of the Rust update (`verl`, the default, `population`, and `verl_tis`: verl's
with truncated importance sampling) it writes the advantages of every group, and per completion
token the ratio and the loss, then the token-mean loss and its gradient with respect to every
token's new log-probability by torch autograd. examples/tests/verl_objective.rs compares the Rust
update with this file, python/tests/gpu/test_dapo_loss.py the Python loop's loss.

verl's objective, as verl's `compute_grpo_outcome_advantage` and `compute_policy_loss_vanilla`
(`loss_agg_mode="token-mean"`) compute it, written here from those functions:

  - advantages per group: (r - mean) / (torch.std(r) + eps), torch.std with Bessel's correction;
    a group of one sample has mean 0 and std 1;
  - ratio = exp(clamp(logp - old_logp, -20, 20));
  - loss1 = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high));
  - where A < 0: min(loss1, -A * clip_ratio_c) (the dual clip), else loss1;
  - the mean over the completion tokens (the response mask).

The `population` objective: (r - mean) / (population std + eps), no log-ratio clamp, no dual clip.

The `verl_tis` objective: verl's, with its token-level truncated importance sampling between the
dual clip and the aggregation (`compute_policy_loss_vanilla` with `rollout_log_probs` and
`tis_imp_ratio_cap` = C, the inputs' `tis_cap`):

  - tis = clamp(exp(old_logp - rollout_logp), max=C);  losses = losses * tis.

Neither old_logp nor rollout_logp carries a gradient, so the gradient of every token is verl's
times its weight. Its output adds `tis_weight` per token.

Where verl itself can be imported (`import verl`), its `compute_grpo_outcome_advantage` and its
`compute_policy_loss` are run on the same inputs too and must agree with the formulas above, and
so is its `compute_policy_loss_vanilla` with `rollout_log_probs` for `verl_tis` where that verl has
it (`--verl-check off` skips both); the output says whether each check ran.
"""

import argparse
import json
import math
import sys
from collections import defaultdict

import torch

DTYPE = torch.float64


def grpo_advantages(scores, index, eps, objective):
    """Per-sample advantages of `scores` (1-D) grouped by `index` (a list of group ids)."""
    rows_of = defaultdict(list)
    for i, g in enumerate(index):
        rows_of[g].append(i)
    out = torch.empty_like(scores)
    for rows in rows_of.values():
        x = scores[rows]
        if objective == "verl":
            if len(rows) == 1:
                mean = torch.tensor(0.0, dtype=DTYPE)
                std = torch.tensor(1.0, dtype=DTYPE)
            else:
                mean = torch.mean(x)
                std = torch.std(x)  # Bessel's correction (n - 1), torch's default
        elif objective == "population":
            mean = torch.mean(x)
            std = torch.sqrt(torch.mean((x - mean) ** 2))
        else:
            raise ValueError(f"unknown objective {objective!r}")
        out[rows] = (x - mean) / (std + eps)
    return out


# each objective of the output: (the objective its loss follows, whether it applies TIS)
OBJECTIVES = {
    "verl": ("verl", False),
    "population": ("population", False),
    "verl_tis": ("verl", True),
}


def tis_weights(old_logp, rollout_logp, cap):
    """verl's token-level truncated importance weights: clamp(exp(old - rollout), max=cap)."""
    return torch.clamp(torch.exp(old_logp - rollout_logp), max=cap)


def policy_loss(logp, old_logp, adv, mask, params, objective, tis=None):
    """Per-token losses (B, L), ratios (B, L) and the token-mean loss; `tis` the per-token
    truncated importance weights (B, L) the losses are multiplied by, or None."""
    log_ratio = logp - old_logp
    if objective == "verl":
        clamp = params["log_ratio_clamp"]
        log_ratio = torch.clamp(log_ratio, min=-clamp, max=clamp)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - params["clip_low"], 1.0 + params["clip_high"])
    clip1 = torch.maximum(pg1, pg2)
    if objective == "verl":
        pg3 = -adv * params["clip_ratio_c"]
        clip2 = torch.minimum(pg3, clip1)
        losses = torch.where(adv < 0, clip2, clip1)
    else:
        losses = clip1
    if tis is not None:
        losses = losses * tis
    loss = (losses * mask).sum() / mask.sum()
    return losses, ratio, loss


class Batch:
    """The inputs as padded tensors: one row per sequence."""

    def __init__(self, inputs):
        self.groups = [g["rewards"] for g in inputs["groups"]]
        self.seqs = inputs["sequences"]
        self.lengths = [len(s["logp"]) for s in self.seqs]
        # rollout log-probabilities (the `verl_tis` objective): on every sequence or none
        self.has_rollout = all("rollout_logp" in s for s in self.seqs)
        for k, s in enumerate(self.seqs):
            if len(s["old_logp"]) != len(s["logp"]) or not s["logp"]:
                sys.exit(f"sequence {k}: logp and old_logp need the same non-zero length")
            if self.has_rollout and len(s["rollout_logp"]) != len(s["logp"]):
                sys.exit(f"sequence {k}: rollout_logp needs the length of logp")
            if not 0 <= s["group"] < len(self.groups):
                sys.exit(f"sequence {k}: no group {s['group']}")
            if not 0 <= s["sample"] < len(self.groups[s["group"]]):
                sys.exit(f"sequence {k}: no sample {s['sample']} in group {s['group']}")
        # one sequence per sample: verl's advantages then see each reward once
        samples = sorted((s["group"], s["sample"]) for s in self.seqs)
        every = [(g, i) for g, rs in enumerate(self.groups) for i in range(len(rs))]
        if samples != every:
            sys.exit("the sequences must be exactly one per sample of every group")
        width = max(self.lengths)
        rows = len(self.seqs)
        self.logp = torch.zeros(rows, width, dtype=DTYPE)
        self.old_logp = torch.zeros(rows, width, dtype=DTYPE)
        self.mask = torch.zeros(rows, width, dtype=DTYPE)
        # padding: rollout = old there, a weight of 1 (masked out anyway)
        self.rollout_logp = torch.zeros(rows, width, dtype=DTYPE)
        for k, s in enumerate(self.seqs):
            n = self.lengths[k]
            self.logp[k, :n] = torch.tensor(s["logp"], dtype=DTYPE)
            self.old_logp[k, :n] = torch.tensor(s["old_logp"], dtype=DTYPE)
            if self.has_rollout:
                self.rollout_logp[k, :n] = torch.tensor(s["rollout_logp"], dtype=DTYPE)
            self.mask[k, :n] = 1.0
        # one score per sample, in group order, and its group id
        self.scores = torch.tensor([r for g in self.groups for r in g], dtype=DTYPE)
        self.index = [gi for gi, g in enumerate(self.groups) for _ in g]
        starts = [0]
        for g in self.groups:
            starts.append(starts[-1] + len(g))
        self.starts = starts
        # each sequence's row in `scores`
        self.sample_row = [starts[s["group"]] + s["sample"] for s in self.seqs]

    def per_group(self, flat):
        return [flat[self.starts[g] : self.starts[g + 1]].tolist() for g in range(len(self.groups))]

    def per_sequence(self, mat):
        return [mat[k, : self.lengths[k]].tolist() for k in range(len(self.seqs))]


def evaluate(batch, params, name):
    objective, with_tis = OBJECTIVES[name]
    adv = grpo_advantages(batch.scores, batch.index, params["adv_eps"], objective)
    adv_tok = adv[batch.sample_row].unsqueeze(-1) * batch.mask
    tis = None
    if with_tis:
        tis = tis_weights(batch.old_logp, batch.rollout_logp, params["tis_cap"])
    logp = batch.logp.clone().requires_grad_(True)
    losses, ratio, loss = policy_loss(
        logp, batch.old_logp, adv_tok, batch.mask, params, objective, tis
    )
    (grad,) = torch.autograd.grad(loss, logp)
    out = {
        "advantages": batch.per_group(adv),
        "ratio": batch.per_sequence(ratio.detach()),
        "token_loss": batch.per_sequence(losses.detach()),
        "loss": loss.item(),
        "dloss_dlogp": batch.per_sequence(grad),
    }
    if tis is not None:
        out["tis_weight"] = batch.per_sequence(tis)
    return out


def close(a, b, rel=1e-9):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-300


def verl_check(batch, params, ours):
    """Runs verl's own functions on the batch, if verl is importable; returns what happened."""
    try:
        import numpy as np
        from verl.trainer.ppo import core_algos
    except Exception as e:  # verl or one of its imports is missing
        return f"not run: verl is not importable here ({type(e).__name__}: {e})"
    if not hasattr(core_algos, "compute_policy_loss"):
        return "not run: this verl has no compute_policy_loss (the keyword-argument form)"
    rows = len(batch.seqs)
    # one reward per sequence, at its first token; verl sums the row
    rewards = torch.zeros(rows, batch.mask.shape[1], dtype=DTYPE)
    for k in range(rows):
        rewards[k, 0] = batch.scores[batch.sample_row[k]]
    index = np.array([f"g{batch.seqs[k]['group']}" for k in range(rows)], dtype=object)
    try:
        adv, _ = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=rewards,
            response_mask=batch.mask,
            index=index,
            epsilon=params["adv_eps"],
        )
        logp = batch.logp.clone().requires_grad_(True)
        out = core_algos.compute_policy_loss(
            old_log_prob=batch.old_logp,
            log_prob=logp,
            advantages=adv,
            response_mask=batch.mask,
            cliprange=params["clip_low"],
            cliprange_low=params["clip_low"],
            cliprange_high=params["clip_high"],
            clip_ratio_c=params["clip_ratio_c"],
            loss_agg_mode="token-mean",
        )
        loss = out[0] if isinstance(out, tuple) else out
        (grad,) = torch.autograd.grad(loss, logp)
    except Exception as e:  # an API that moved: say so, do not fail the oracle
        return f"not run: verl's functions failed on these inputs ({type(e).__name__}: {e})"
    # every sample appears as one sequence here
    got_adv = {}
    for k in range(rows):
        got_adv[batch.sample_row[k]] = adv[k, 0].item()
    want_adv = ours["advantages"]
    flat_want = [a for g in want_adv for a in g]
    bad = [
        (row, got, flat_want[row])
        for row, got in got_adv.items()
        if not close(got, flat_want[row], rel=1e-6)
    ]
    if bad:
        sys.exit(f"verl's advantages differ from this oracle's (row, verl, oracle): {bad[:5]}")
    if not close(loss.item(), ours["loss"], rel=1e-6):
        sys.exit(f"verl's loss {loss.item()} differs from this oracle's {ours['loss']}")
    grads = batch.per_sequence(grad)
    for k, (g, w) in enumerate(zip(grads, ours["dloss_dlogp"])):
        for j, (x, y) in enumerate(zip(g, w)):
            if not close(x, y, rel=1e-6):
                sys.exit(f"verl's gradient differs at sequence {k} token {j}: {x} vs {y}")
    version = getattr(sys.modules.get("verl"), "__version__", "unknown")
    return f"passed: verl {version}'s compute_grpo_outcome_advantage and compute_policy_loss agree"


def verl_tis_check(batch, params, ours):
    """Runs verl's `compute_policy_loss_vanilla` with `rollout_log_probs` on the batch (verl's
    advantages taken from this oracle's, already checked by `verl_check`), if this verl has it."""
    try:
        import inspect

        from verl.trainer.ppo import core_algos
        from omegaconf import OmegaConf  # verl's config library, there wherever verl is
    except Exception as e:  # verl or one of its imports is missing
        return f"not run: verl is not importable here ({type(e).__name__}: {e})"
    fn = getattr(core_algos, "compute_policy_loss_vanilla", None)
    if fn is None or "rollout_log_probs" not in inspect.signature(fn).parameters:
        return "not run: this verl's compute_policy_loss_vanilla takes no rollout_log_probs"
    flat = [a for g in ours["advantages"] for a in g]
    adv = torch.tensor([flat[row] for row in batch.sample_row], dtype=DTYPE)
    adv = adv.unsqueeze(-1) * batch.mask
    config = OmegaConf.create(
        {
            "clip_ratio": params["clip_low"],
            "clip_ratio_low": params["clip_low"],
            "clip_ratio_high": params["clip_high"],
            "clip_ratio_c": params["clip_ratio_c"],
            "tis_imp_ratio_cap": params["tis_cap"],
        }
    )
    try:
        logp = batch.logp.clone().requires_grad_(True)
        out = fn(
            old_log_prob=batch.old_logp,
            log_prob=logp,
            advantages=adv,
            response_mask=batch.mask,
            loss_agg_mode="token-mean",
            config=config,
            rollout_log_probs=batch.rollout_logp,
        )
        loss = out[0] if isinstance(out, tuple) else out
        (grad,) = torch.autograd.grad(loss, logp)
    except Exception as e:  # an API that moved: say so, do not fail the oracle
        return f"not run: verl's compute_policy_loss_vanilla failed ({type(e).__name__}: {e})"
    if not close(loss.item(), ours["loss"], rel=1e-6):
        sys.exit(f"verl's TIS loss {loss.item()} differs from this oracle's {ours['loss']}")
    for k, (g, w) in enumerate(zip(batch.per_sequence(grad), ours["dloss_dlogp"])):
        for j, (x, y) in enumerate(zip(g, w)):
            if not close(x, y, rel=1e-6):
                sys.exit(f"verl's TIS gradient differs at sequence {k} token {j}: {x} vs {y}")
    version = getattr(sys.modules.get("verl"), "__version__", "unknown")
    return f"passed: verl {version}'s compute_policy_loss_vanilla with rollout_log_probs agrees"


def finite(x):
    if isinstance(x, list):
        return all(finite(v) for v in x)
    return math.isfinite(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", required=True, help="verl_loss_inputs.json")
    parser.add_argument("--out", required=True, help="where to write the results (JSON)")
    parser.add_argument(
        "--verl-check",
        choices=["auto", "off"],
        default="auto",
        help="also run verl's own functions where verl can be imported (default: auto)",
    )
    args = parser.parse_args()
    with open(args.inputs) as f:
        inputs = json.load(f)
    params = {
        k: float(inputs[k])
        for k in ["clip_low", "clip_high", "clip_ratio_c", "adv_eps", "log_ratio_clamp"]
    }
    batch = Batch(inputs)
    names = ["verl", "population"]
    if batch.has_rollout and "tis_cap" in inputs:
        params["tis_cap"] = float(inputs["tis_cap"])
        names.append("verl_tis")
    else:
        print("no rollout_logp / tis_cap in the inputs: verl_tis not computed", file=sys.stderr)
    objectives = {name: evaluate(batch, params, name) for name in names}
    for name, res in objectives.items():
        for key, value in res.items():
            if not finite(value):
                sys.exit(f"{name}: {key} has a value that is not finite")
    tis_check = None
    if args.verl_check == "off":
        check = "not run: --verl-check off"
        tis_check = check
    else:
        check = verl_check(batch, params, objectives["verl"])
        if "verl_tis" in objectives:
            tis_check = verl_tis_check(batch, params, objectives["verl_tis"])
    doc = {
        "about": "verl's objective, the population variant and verl's objective with truncated "
        "importance sampling on verl_loss_inputs.json, by torch autograd",
        "made_by": "scripts/oracles/verl_loss.py",
        "torch_version": torch.__version__,
        "dtype": "float64",
        "device": "cpu",
        "verl_check": check,
        "verl_tis_check": tis_check,
        "inputs": inputs,
        "objectives": objectives,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
    tokens = sum(batch.lengths)
    losses = ", ".join(f"{name} loss {res['loss']:.9g}" for name, res in objectives.items())
    print(
        f"wrote {args.out}: {len(batch.groups)} groups, {len(batch.seqs)} sequences, "
        f"{tokens} tokens; {losses}; verl check: {check}; verl TIS check: {tis_check}"
    )


if __name__ == "__main__":
    main()
