"""The shared inputs of the verl-objective oracle and its truncated importance sampling (TIS),
checked without torch (float64 through `math`):

- examples/tests/fixtures/verl_loss_inputs.json is what scripts/oracles/verl_loss_inputs.py
  writes (nobody edited it by hand);
- verl's objective written here again reproduces the torch reference's `verl` objective
  (examples/tests/fixtures/verl_loss_torch.json), so these formulas are verl's;
- the same formulas with TIS (each token's loss and gradient times
  min(exp(old_logp - rollout_logp), tis_cap)) reproduce the reference's `verl_tis` objective once
  the reference has it (scripts/oracles/verl_loss.py on a machine with torch), and meanwhile
  change the loss, with weights below 1, between 1 and the cap, and truncated at the cap.
"""

import importlib.util
import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "examples/tests/fixtures"
TIS_MEMBERS = ("tis_cap", "tis_cases", "rollout_logp")


def load(name):
    return json.loads((FIXTURES / name).read_text())


def without_tis(v):
    """The inputs without the members TIS added (what the `verl` objective is computed from)."""
    if isinstance(v, dict):
        return {k: without_tis(x) for k, x in v.items() if k not in TIS_MEMBERS}
    if isinstance(v, list):
        return [without_tis(x) for x in v]
    return v


def advantages(rewards, eps):
    """verl's GRPO advantages of one group: Bessel's std, mean 0 and std 1 for one sample."""
    n = len(rewards)
    if n == 1:
        mean, std = 0.0, 1.0
    else:
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def token(logp, old, adv, inputs, rollout=None):
    """verl's per-token loss and its derivative with respect to logp (the inputs have no ties),
    times the TIS weight when `rollout` is given."""
    clamp = inputs["log_ratio_clamp"]
    d = logp - old
    ratio = math.exp(max(-clamp, min(clamp, d)))
    dratio = ratio if abs(d) <= clamp else 0.0
    lo, hi = 1 - inputs["clip_low"], 1 + inputs["clip_high"]
    pg1, pg2 = -adv * ratio, -adv * min(max(ratio, lo), hi)
    loss, grad = (pg1, -adv * dratio) if pg1 >= pg2 else (pg2, 0.0)
    pg3 = -adv * inputs["clip_ratio_c"]
    if adv < 0 and pg3 < loss:
        loss, grad = pg3, 0.0
    if rollout is not None:
        w = min(math.exp(old - rollout), inputs["tis_cap"])
        loss, grad = loss * w, grad * w
    return loss, grad


def objective(inputs, tis):
    """The token-mean loss, per-token losses and gradients of every sequence."""
    adv = [advantages(g["rewards"], inputs["adv_eps"]) for g in inputs["groups"]]
    n = sum(len(s["logp"]) for s in inputs["sequences"])
    total, losses, grads = 0.0, [], []
    for s in inputs["sequences"]:
        a = adv[s["group"]][s["sample"]]
        ls, gs = [], []
        for j, (lp, old) in enumerate(zip(s["logp"], s["old_logp"])):
            loss, grad = token(lp, old, a, inputs, s["rollout_logp"][j] if tis else None)
            total += loss
            ls.append(loss)
            gs.append(grad / n)
        losses.append(ls)
        grads.append(gs)
    return {"advantages": adv, "loss": total / n, "token_loss": losses, "dloss_dlogp": grads}


def close(a, b, rel=1e-12):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-300


def assert_matches(ours, want, what):
    assert close(ours["loss"], want["loss"]), f"{what}: loss {ours['loss']} vs {want['loss']}"
    for key in ("advantages", "token_loss", "dloss_dlogp"):
        for k, (a, b) in enumerate(zip(ours[key], want[key])):
            assert len(a) == len(b), f"{what}: {key}[{k}] lengths"
            for j, (x, y) in enumerate(zip(a, b)):
                assert close(x, y), f"{what}: {key}[{k}][{j}]: {x} vs torch {y}"


def test_the_inputs_are_what_the_generator_writes(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "verl_loss_inputs", ROOT / "scripts/oracles/verl_loss_inputs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "inputs.json"
    argv = sys.argv
    sys.argv = ["verl_loss_inputs.py", "--out", str(out)]
    try:
        module.main()
    finally:
        sys.argv = argv
    assert out.read_text() == (FIXTURES / "verl_loss_inputs.json").read_text()


def test_these_formulas_are_the_torch_references_verl_objective():
    inputs, torch_ref = load("verl_loss_inputs.json"), load("verl_loss_torch.json")
    assert without_tis(torch_ref["inputs"]) == without_tis(inputs)
    assert_matches(objective(inputs, tis=False), torch_ref["objectives"]["verl"], "verl")


def test_truncated_importance_sampling():
    inputs, torch_ref = load("verl_loss_inputs.json"), load("verl_loss_torch.json")
    ours = objective(inputs, tis=True)
    cap = inputs["tis_cap"]
    weights = [
        math.exp(o - r)
        for s in inputs["sequences"]
        for o, r in zip(s["old_logp"], s["rollout_logp"])
    ]
    assert any(w < 1 for w in weights) and any(1 < w < cap for w in weights)
    assert any(w > cap for w in weights), "no token where the cap truncates the weight"
    assert all(abs(w / cap - 1) > 1e-2 for w in weights), "a weight next to the cap"
    plain = objective(inputs, tis=False)
    assert not close(ours["loss"], plain["loss"], rel=1e-3)
    want = torch_ref["objectives"].get("verl_tis")
    if want is None:
        pytest.skip(
            "the torch reference has no verl_tis objective yet: make it on a machine with torch "
            "(scripts/oracles/verl_loss.py, see examples/tests/fixtures/README.md)"
        )
    assert torch_ref["inputs"] == inputs
    assert_matches(ours, want, "verl_tis")
