"""python/examples/loss.py (the loss of python/examples/dapo.py) computes verl's objective: its
advantages and loss, with and without truncated importance sampling, evaluated with torch on the
shared inputs, equal the torch oracle's output that the Rust loop is checked against too
(examples/tests/fixtures/verl_loss_torch.json); and its mismatch figures are the formulas'."""

import importlib.util
import json
import math
import pathlib

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[3]
MAKE_TORCH = (
    "python3 scripts/oracles/verl_loss.py --inputs examples/tests/fixtures/verl_loss_inputs.json "
    "--out examples/tests/fixtures/verl_loss_torch.json"
)


def loss_module():
    spec = importlib.util.spec_from_file_location("dapo_loss", ROOT / "python/examples/loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def oracle():
    return json.loads((ROOT / "examples/tests/fixtures/verl_loss_torch.json").read_text())


def check_objective(name, tis):
    """loss.py's advantages, loss and gradient against the oracle's objective `name`."""
    reference = oracle()
    if name not in reference["objectives"]:
        pytest.fail(
            f"the torch reference has no `{name}` objective: make it again on a machine with "
            f"torch, from the repository root: `{MAKE_TORCH}`"
        )
    inputs, want = reference["inputs"], reference["objectives"][name]
    d = loss_module()
    adv = [d.advantages(torch.tensor(g["rewards"], dtype=torch.float64)) for g in inputs["groups"]]
    for got, expected in zip(adv, want["advantages"]):
        assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    logp, old, rollout, a = [], [], [], []
    for s in inputs["sequences"]:
        logp += s["logp"]
        old += s["old_logp"]
        rollout += s.get("rollout_logp", s["old_logp"])
        a += [float(adv[s["group"]][s["sample"]])] * len(s["logp"])
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float64)
    rollout = torch.tensor(rollout, dtype=torch.float64)
    a = torch.tensor(a, dtype=torch.float64)
    loss = d.verl_loss(
        logp,
        old,
        a,
        torch.ones_like(a),
        rollout_logp=rollout if tis else None,
        tis_cap=inputs["tis_cap"] if tis else None,
        clip_low=inputs["clip_low"],
        clip_high=inputs["clip_high"],
        clip_c=inputs["clip_ratio_c"],
    )
    assert abs(float(loss) - want["loss"]) < 1e-12
    (grad,) = torch.autograd.grad(loss, logp)
    flat = [g for seq in want["dloss_dlogp"] for g in seq]
    assert torch.allclose(grad, torch.tensor(flat, dtype=torch.float64), rtol=1e-9, atol=1e-15)
    if tis:
        weights = d.tis_weights(old, rollout, inputs["tis_cap"])
        flat = [w for seq in want["tis_weight"] for w in seq]
        assert torch.allclose(weights, torch.tensor(flat, dtype=torch.float64), rtol=1e-12, atol=0)


def test_the_python_loop_computes_verls_objective():
    check_objective("verl", tis=False)


def test_the_python_loop_computes_verls_objective_with_truncated_importance_sampling():
    check_objective("verl_tis", tis=True)


def test_tis_off_is_verls_loss_and_the_weights_carry_no_gradient():
    d = loss_module()
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.25, -2.0, -0.25]], dtype=torch.float64)
    rollout = torch.tensor([[-2.0, -1.0, -0.25]], dtype=torch.float64)  # weights 2 (capped), e^-1, 1
    adv, mask = torch.tensor([[0.5]], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    plain = d.verl_loss(logp, old, adv, mask)
    for off in (None, 0.0):
        assert float(d.verl_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=off)) == float(plain)
    (g_plain,) = torch.autograd.grad(plain, logp)
    tis = d.verl_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=2.0)
    (g_tis,) = torch.autograd.grad(tis, logp)
    w = torch.tensor([[2.0, math.exp(-1.0), 1.0]], dtype=torch.float64)
    assert torch.allclose(g_tis, g_plain * w, rtol=1e-12, atol=0)


def test_mismatch_is_the_mean_abs_difference_and_the_k3_estimate():
    d = loss_module()
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    rollout = torch.tensor([[-1.0, -2.5, -3.0], [-0.25, -0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token is padding
    delta, kl = d.mismatch(old, rollout, mask)
    r = [0.0, 0.5, 0.0, -0.25, 0.0]
    assert abs(delta - sum(abs(x) for x in r) / 5) < 1e-7
    assert abs(kl - sum(math.expm1(x) - x for x in r) / 5) < 1e-7
    assert kl >= 0
