"""How long `switch.rollout()` takes to switch a real FSDP2 model at W = 1, beside the naive
verl-style path (`full_tensor()` of every parameter copied into a separate bf16 rollout
model) on the same parameters, in one process.

    python python/bench/fsdp2_enter.py [--model 7b|1.5b] [--iters 5] [--offload]

Prints one JSON object (and writes it to $OUT/fsdp2_enter.json when OUT is set). The model is a
transformers Qwen2 made from a config (Qwen2.5-7B or -1.5B shapes, fp32, random weights).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

import lifecycle

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--offload", action="store_true", help="also time offload='all' with AdamW state")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    config = transformers.Qwen2Config(
        **SHAPES[args.model], rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(config).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    res = {"model": args.model, "params": params, "build_s": time.perf_counter() - t0,
           "torch": torch.__version__, "device": torch.cuda.get_device_name()}

    switch = lifecycle.Switch.from_fsdp2(model)
    t = time.perf_counter()
    with switch.rollout() as w:
        rollout_bytes = sum(x.numel() * x.element_size() for _, x in w.named_tensors())
    res["first_enter_ms"] = 1e3 * (time.perf_counter() - t)
    walls, inside, calls = [], [], []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with switch.rollout(refresh=True):
            pass
        walls.append(1e3 * (time.perf_counter() - t))
        inside.append(1e3 * switch.last_enter[2])
    for _ in range(args.iters):
        t = time.perf_counter()
        with switch.rollout():
            pass
        calls.append(1e3 * (time.perf_counter() - t))
    res["rollout_bytes"] = rollout_bytes
    res["refresh_ms"] = walls
    res["refresh_ms_min"] = min(walls)
    res["refresh_in_rust_ms"] = inside
    res["lazy_call_ms"] = calls
    res["stats"] = switch.stats()

    # the naive path: full_tensor() of every parameter into a separate bf16 rollout model
    named = list(model.named_parameters())
    rollout = {n: torch.empty(p.shape, dtype=torch.bfloat16, device="cuda") for n, p in named}

    def naive():
        with torch.no_grad():
            for n, p in named:
                rollout[n].copy_(p.full_tensor())

    naive()
    ts = []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        naive()
        torch.cuda.synchronize()
        ts.append(1e3 * (time.perf_counter() - t))
    res["naive_full_tensor_ms"] = ts
    res["naive_full_tensor_ms_min"] = min(ts)
    # identical bytes
    with switch.rollout() as w:
        res["identical_to_naive"] = all(torch.equal(x, rollout[n]) for n, x in w.named_tensors())
    del rollout
    switch.train()

    if args.offload:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        off = lifecycle.Switch.from_fsdp2(model, offload="all", optimizer=opt)
        enters, exits = [], []
        for i in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with off.rollout(refresh=True):
                pass
            enters.append(1e3 * (time.perf_counter() - t))
            t = time.perf_counter()
            off.train()
            torch.cuda.synchronize()
            exits.append(1e3 * (time.perf_counter() - t))
        res["offload_enter_ms"] = enters
        res["offload_exit_ms"] = exits
        res["offload_bytes"] = sum(p.numel() * 4 * 3 for p in model.parameters())
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fsdp2_enter.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
