"""Handed-out rollout tensors keep their memory alive, whatever is dropped first: each exporter
x each drop order runs in its own process (lifetimes.py), overwrites the freed memory, then
reads every byte of the tensors. A difference or a crash fails."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_case(exporter, drop, *extra):
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "lifetimes.py"), exporter, drop, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, (
        f"{exporter} / {drop}: exit {out.returncode}\n{out.stdout}\n{out.stderr[-2000:]}"
    )
    assert out.stdout.startswith("OK"), out.stdout
    return out.stdout


@pytest.mark.parametrize("drop", ["session", "switch", "helper", "close", "exit"])
@pytest.mark.parametrize("exporter", ["numpy", "capsule"])
def test_host_views_outlive_what_made_them(exporter, drop):
    run_case(exporter, drop)


@pytest.mark.parametrize("drop", ["switch", "helper"])
def test_host_torch_tensors_outlive_the_switch(drop):
    pytest.importorskip("torch")
    run_case("torch", drop)
