"""CUDA rollout tensors (torch tensors from `named_tensors`, raw DLPack capsules consumed by
torch later) keep their device memory alive whatever goes first: the session, the switch, the
engine, or all of them (a helper that returns only the tensors); an explicit close while they
live is refused by name. Each case runs in its own process (../lifetimes.py), which fills the
freed device memory before it reads every byte back."""

import os
import subprocess
import sys

import pytest

import gpu_support  # noqa: F401  (skips without torch or a GPU)

LIFETIMES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lifetimes.py")


@pytest.mark.parametrize("drop", ["session", "switch", "engine", "helper", "close", "exit"])
@pytest.mark.parametrize("exporter", ["torch", "capsule"])
def test_cuda_views_outlive_what_made_them(exporter, drop):
    # a process of its own: not the test session's process group or port
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    out = subprocess.run(
        [sys.executable, LIFETIMES, exporter, drop, "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    print(out.stdout)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert out.stdout.startswith("OK"), out.stdout
