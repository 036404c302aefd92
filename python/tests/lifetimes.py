"""One lifetime case, in a process of its own: rollout tensors handed out by one exporter, then
something dropped first (the session, the switch, the engine, or all of them at once), then
the freed memory overwritten, then every byte of the tensors read and compared with the bf16 of
the masters computed independently. Prints ``OK`` and exits 0 when every byte matches; a
difference exits 1, a crash kills the process (both fail the test that runs this).

    python lifetimes.py EXPORTER DROP [--device cuda]

EXPORTER: ``numpy`` (``named_arrays``), ``capsule`` (raw DLPack capsules of the handles, consumed
only after the drop), ``torch`` (``named_tensors``). DROP: ``session``, ``switch``, ``engine``
(cuda), ``helper`` (everything built in a function that returns only the tensors), ``close``
(an explicit close while they live: refused by name, then the tensors read), ``exit`` (the
tensors and the switch left to the interpreter's exit, the CUDA driver's teardown after it: the
process must still exit 0)."""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lifecycle  # noqa: E402
from support import QWEN2, bf16_bits  # noqa: E402


class Capsule:
    """A DLPack capsule taken earlier, offered to a consumer later."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **_):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def host_switch(exporter):
    rng = np.random.default_rng(11)
    cfg = dict(QWEN2, hidden_size=64, intermediate_size=128, vocab_size=256)
    params = [
        (n, rng.standard_normal(s).astype(np.float32))
        for n, s in lifecycle.expected_parameters(json.dumps(cfg))
    ]
    want = {n: bf16_bits(a) for n, a in params}
    if exporter == "torch":
        import torch

        params = [(n, torch.from_numpy(a)) for n, a in params]
    return lifecycle.Switch.from_arrays(cfg, params, world=2, rollout_tp=1), want, None


def cuda_switch(exporter, drop):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
    from gpu_support import fsdp2_model, qwen2_config

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 300))
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    model = fsdp2_model(qwen2_config(), seed=4)
    want = {
        n: p.full_tensor().detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        for n, p in model.named_parameters()
    }
    switch = lifecycle.Switch.from_fsdp2(model)
    engine = None
    if drop == "engine":
        engine = lifecycle.Engine(switch, max_sequences=2, max_tokens=32)
    return switch, want, engine, model


def export(w, exporter, device):
    """The tensors of session ``w``, as the exporter hands them out."""
    if exporter == "numpy":
        return dict(w.named_arrays("hf"))
    if exporter == "capsule":
        dev = (2, 0) if device == "cuda" else (1, 0)
        return {h.name: Capsule(h.__dlpack__(), dev) for h in w.handles(bits=True)}
    if exporter == "torch":
        return dict(w.named_tensors("hf"))
    raise SystemExit(f"unknown exporter {exporter}")


def as_bits(x, device):
    """Every byte of a handed-out tensor, as uint16 bits on the host."""
    if isinstance(x, Capsule):
        if device == "cuda":
            import torch

            return torch.from_dlpack(x.capsule).cpu().numpy().view(np.uint16)
        return np.from_dlpack(x).copy()
    if type(x).__module__.startswith("torch"):
        import torch

        return x.view(torch.int16).cpu().numpy().view(np.uint16)
    return np.array(x, copy=True)


def overwrite(device, nbytes):
    """Allocates and fills about 4x ``nbytes`` in many sizes, so freed memory is reused."""
    junk = []
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
        for size in (1 << 12, 1 << 16, 1 << 20, 1 << 22):
            for _ in range(max(1, 4 * nbytes // size // 4)):
                junk.append(torch.full((size,), 0xA5, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
    else:
        for size in (1 << 10, 1 << 14, 1 << 18):
            for _ in range(max(1, 4 * nbytes // size // 3)):
                junk.append(np.full(size, 0xA5, np.uint8))
    return junk


def main() -> int:
    exporter, drop = sys.argv[1], sys.argv[2]
    device = "cuda" if "--device" in sys.argv and sys.argv[-1] == "cuda" else "cpu"
    warnings.simplefilter("always")

    def build():
        if device == "cuda":
            switch, want, engine, model = cuda_switch(exporter, drop)
        else:
            (switch, want, engine), model = host_switch(exporter), None
        with switch.rollout() as w:
            if engine is not None:
                engine.generate(w, [[1, 2, 3]], max_new_tokens=4)
            views = export(w, exporter, device)
        return switch, want, engine, model, views

    if drop == "helper":
        # nothing but the tensors and the expected bits leaves the function
        def helper():
            _, want, _, _, views = build()
            return want, views

        with warnings.catch_warnings(record=True) as caught:
            want, views = helper()
            gc.collect()
        if not any("still reference its weights" in str(c.message) for c in caught):
            print("no warning when the switch was collected with tensors alive")
            return 1
    else:
        switch, want, engine, model, views = build()
        if drop == "session":
            pass
        elif drop == "switch":
            with warnings.catch_warnings(record=True) as caught:
                del switch
                gc.collect()
            if not any("still reference its weights" in str(c.message) for c in caught):
                print("no warning when the switch was collected with tensors alive")
                return 1
        elif drop == "engine":
            del engine, switch
            gc.collect()
        elif drop == "exit":
            # read below, then everything is left to the interpreter's exit
            global KEPT
            KEPT = (switch, engine, model, views)
        elif drop == "close":
            try:
                switch.close()
            except lifecycle.TensorsInUseError as e:
                if len(str(e)) > 400 or "close" not in str(e):
                    print(f"close refused with a poor message: {e}")
                    return 1
            else:
                print("close() freed memory that handed-out tensors reference")
                return 1
            if switch.closed:
                print("a refused close() closed the switch")
                return 1
        else:
            raise SystemExit(f"unknown drop {drop}")
    nbytes = sum(v.nbytes for v in want.values())
    junk = overwrite(device, nbytes)
    bad = []
    for name, bits in want.items():
        got = as_bits(views[name], device)
        if got.shape != bits.shape or not np.array_equal(got, bits):
            bad.append(name)
    del junk
    if bad:
        print(f"{len(bad)} of {len(want)} tensors read other bytes than their weights: {bad[:3]}")
        return 1
    del views
    gc.collect()
    print(f"OK {exporter} {drop} {device}: {len(want)} tensors, {nbytes} bytes read back intact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
