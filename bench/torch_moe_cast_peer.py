#!/usr/bin/env python3
"""PyTorch peer of a W = 1 rollout enter for a mixture-of-experts model: every fp32 master
parameter cast into one flat bf16 rollout buffer, on one GPU, as a PyTorch RL stack does when it
materialises the inference weights (no NCCL at W = 1; the switch is a cast of every tensor).

    python3 bench/torch_moe_cast_peer.py [--layers 8] [--iters 5]

Shapes: Qwen3-30B-A3B (hidden 2048, 32 q heads / 4 kv heads of 128, q/k norms, 128 experts of
intermediate 768 per layer as separate tensors, vocabulary 151936, untied head) with --layers
layers: the same tensors `fsdp_bench --model qwen3-30b-a3b` builds. Variants:
  per_tensor   `buf[off:off+n].copy_(p.view(-1))` per parameter (one cast kernel per tensor);
  foreach      `torch._foreach_copy_` over all parameters into bf16 views (multi-tensor kernels);
  ceiling      one cast of a single fp32 tensor holding all parameters (what no variant beats).
Prints one JSON object (median seconds of --iters timed runs after two warm-ups).
"""
import argparse
import json

import torch


def shapes(layers):
    h, heads, kv, d, experts, f, vocab = 2048, 32, 4, 128, 128, 768, 151936
    out = [(vocab, h)]
    for _ in range(layers):
        out += [(h,), (heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d), (d,), (d,), (h,),
                (experts, h)]
        for _ in range(experts):
            out += [(f, h), (f, h), (h, f)]
    out += [(h,), (vocab, h)]
    return out


def timed(fn, iters, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    sh = shapes(args.layers)
    numel = [int(torch.Size(s).numel()) for s in sh]
    total = sum(numel)
    params = [torch.randn(s, device=dev) * 0.02 for s in sh]
    buf = torch.empty(total, dtype=torch.bfloat16, device=dev)
    views, off = [], 0
    for n, s in zip(numel, sh):
        views.append(buf[off:off + n].view(s))
        off += n

    def per_tensor():
        for v, p in zip(views, params):
            v.copy_(p)

    def foreach():
        torch._foreach_copy_(views, params)

    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "layers": args.layers,
           "tensors": len(sh), "params": total, "rollout_bytes": 2 * total}
    res["per_tensor_s"] = timed(per_tensor, args.iters)
    check = buf.clone()
    res["foreach_s"] = timed(foreach, args.iters)
    res["variants_identical"] = bool(torch.equal(check, buf))
    del params
    flat = torch.randn(total, device=dev) * 0.02
    res["ceiling_one_cast_s"] = timed(lambda: buf.copy_(flat), args.iters)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
