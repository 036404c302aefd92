"""python/examples/dapo.py computes verl's objective: its advantages and loss, evaluated with
torch on the shared inputs, equal the torch oracle's output that the Rust loop is checked
against too (examples/tests/fixtures/verl_loss_torch.json)."""

import importlib.util
import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[3]


def dapo():
    spec = importlib.util.spec_from_file_location("dapo_example", ROOT / "python/examples/dapo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_python_loop_computes_verls_objective():
    oracle = json.loads((ROOT / "examples/tests/fixtures/verl_loss_torch.json").read_text())
    inputs, want = oracle["inputs"], oracle["objectives"]["verl"]
    d = dapo()
    adv = [d.advantages(torch.tensor(g["rewards"], dtype=torch.float64)) for g in inputs["groups"]]
    for got, expected in zip(adv, want["advantages"]):
        assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    logp, old, a = [], [], []
    for s in inputs["sequences"]:
        logp += s["logp"]
        old += s["old_logp"]
        a += [float(adv[s["group"]][s["sample"]])] * len(s["logp"])
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old, dtype=torch.float64)
    a = torch.tensor(a, dtype=torch.float64)
    loss = d.verl_loss(
        logp, old, a, torch.ones_like(a),
        inputs["clip_low"], inputs["clip_high"], inputs["clip_ratio_c"],
    )
    assert abs(float(loss) - want["loss"]) < 1e-12
    (grad,) = torch.autograd.grad(loss, logp)
    flat = [g for seq in want["dloss_dlogp"] for g in seq]
    assert torch.allclose(grad, torch.tensor(flat, dtype=torch.float64), rtol=1e-9, atol=1e-15)
