"""``Switch.from_megatron`` over several Megatron-Core ranks, a process each: each process
builds its rank of a TP x PP x DP ``GPTModel`` (local spec, DDP with the distributed optimizer)
and its switch; the rollout, at every T dividing the world, must be bit-identical to the host
switch's rollout of the whole model (Rust's rollout layout of the same weights, from
``Switch.from_arrays``), fused as the Megatron switch fuses it.

``--backend gloo`` (the default): every rank on GPU 0, so each process's switch reads every
rank's parameters in place (the other processes' through CUDA IPC) and checks every rollout
rank. ``--backend nccl``: a GPU per rank, each process's switch one rank of an NCCL world,
checking the rollout rank it holds.

    torchrun --nproc_per_node=2 python/tests/gpu/megatron_ranks.py --tp 2
    torchrun --nproc_per_node=2 python/tests/gpu/megatron_ranks.py --pp 2
    torchrun --nproc_per_node=4 python/tests/gpu/megatron_ranks.py --tp 2 --pp 2
    torchrun --nproc_per_node=2 python/tests/gpu/megatron_ranks.py --dp 2 [--qk-norm] [--moe]
    torchrun --nproc_per_node=2 python/tests/gpu/megatron_ranks.py --dp 2 --moe --ep 2
    torchrun --nproc_per_node=2 python/tests/gpu/megatron_ranks.py --tp 2 --backend nccl

Prints one line per rank; exits non-zero on any mismatch.
"""

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lifecycle  # noqa: E402
from lifecycle._megatron import first_layer, layout_name  # noqa: E402
from megatron_support import EXPERTS, expected, hf_config, megatron_model, whole  # noqa: E402


def unfused(named: dict, hf: dict, rank: int, t: int) -> dict:
    """The host switch's unfused rollout of rollout rank ``rank`` of ``t``, fused as the Megatron
    switch fuses it: where the kv heads are fewer than T the host layout replicates k and v
    whole, the fused one gives rank r the kv head its query heads read (group r / (T / kv))."""
    kv, d = hf["num_key_value_heads"], hf["head_dim"]

    def own_kv(x):
        if t <= kv:
            return x
        g = rank // (t // kv)
        return x[g * d : (g + 1) * d]

    out = {}
    for n, a in named.items():
        if ".k_proj." in n or ".v_proj." in n or ".up_proj." in n:
            continue
        if ".q_proj." in n:
            parts = [named[n]] + [own_kv(named[n.replace("q_proj", x)]) for x in ("k_proj", "v_proj")]
            out[n.replace("q_proj", "qkv_proj")] = np.concatenate(parts)
        elif ".gate_proj." in n:
            parts = [named[n.replace("gate_proj", x)] for x in ("gate_proj", "up_proj")]
            out[n.replace("gate_proj", "gate_up_proj")] = np.concatenate(parts)
        else:
            out[n] = a
    return out


def hf_unfused(fused: dict, hf: dict) -> dict:
    """The whole model's fused tensors (T = 1) under the unfused Hugging Face names the host
    switch takes, as fp32 arrays (exact: bf16 widened)."""
    out = {}
    q_rows = hf["num_attention_heads"] * hf["head_dim"]
    kv_rows = hf["num_key_value_heads"] * hf["head_dim"]
    for n, t in fused.items():
        a = t.float().cpu().numpy().copy()  # the host switch holds its arrays read-only
        if "qkv_proj" in n:
            for x, part in zip(np.split(a, [q_rows, q_rows + kv_rows]), ("q", "k", "v")):
                out[n.replace("qkv_proj", f"{part}_proj")] = x
        elif "gate_up_proj" in n and "experts" not in n:
            gate, up = np.split(a, 2)
            out[n.replace("gate_up_proj", "gate_proj")] = gate
            out[n.replace("gate_up_proj", "up_proj")] = up
        else:
            out[n] = a
    return out


def bits(t) -> np.ndarray:
    return t.contiguous().view(torch.int16).cpu().numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--qk-norm", action="store_true")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--ep", type=int, default=1, help="expert parallelism (with --moe)")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    args = ap.parse_args()
    shared = args.backend == "gloo"
    torch.cuda.set_device(0 if shared else int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == args.tp * args.pp * args.dp, "TP x PP x DP must be the world"
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(args.tp, args.pp, expert_model_parallel_size=args.ep)
    hf = hf_config(args.qk_norm, args.moe, layers=2 * args.pp)
    try:
        model, gpt, opt = megatron_model(args.qk_norm, args.moe, layers=2 * args.pp)
    except Exception as e:  # report why, on every rank
        print(f"rank {rank}: Megatron-Core could not build the model over {args.backend}: {e!r}")
        sys.exit(2)
    # Megatron-Core 0.19 draws each TP rank's router apart (a replicated parameter a loaded
    # checkpoint makes equal): made equal here from TP rank 0, on the host
    with torch.no_grad():
        for n, p in gpt.named_parameters():
            if n.endswith("router.weight"):
                t = p.detach().cpu() if shared else p.detach().clone()
                dist.broadcast(
                    t, src=ps.get_tensor_model_parallel_src_rank(),
                    group=ps.get_tensor_model_parallel_group(),
                )
                p.copy_(t.to(p.device))
    coords = (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )
    # the experts by their expert-layer coordinates, each local expert under its global index
    expert_coords = (
        ps.get_expert_tensor_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_expert_data_parallel_rank(),
    )
    first_expert = ps.get_expert_model_parallel_rank() * (EXPERTS // args.ep)
    start = first_layer(gpt)
    mine = {layout_name(n, start): t.detach().cpu() for n, t in gpt.named_parameters()}
    dense = {n: t for n, t in mine.items() if ".experts." not in n}
    experts = {
        re.sub(r"weight(\d+)$", lambda m: f"weight{first_expert + int(m.group(1))}", n): t
        for n, t in mine.items()
        if ".experts." in n
    }
    every = [None] * world
    dist.all_gather_object(every, (coords, dense, expert_coords, experts))
    joined = whole([(c, d) for c, d, _, _ in every], args.tp)
    if args.moe:
        etp = ps.get_expert_tensor_parallel_world_size()
        joined.update(whole([(c, e) for _, _, c, e in every], etp))
    fused = expected(joined, args.qk_norm, args.moe, layers=2 * args.pp)
    full = hf_unfused(fused, hf)
    bad, checked = [], []
    # T > 1 against the host switch's rollout (dense; the experts at T = 1 only)
    for t in [t for t in (1, 2, 4) if world % t == 0 and (t == 1 or not args.moe)]:
        ref = {}
        if t > 1:
            host = lifecycle.Switch.from_arrays(hf, full, world=t, rollout_tp=t)
            with host.rollout() as w:
                ref = {r: unfused(dict(w.named_arrays(rank=r)), hf, r, t) for r in range(t)}
        switch = lifecycle.Switch.from_megatron(model, opt, hf, rollout_tp=t)
        with switch.rollout() as w:
            # every rollout rank here (shared GPU), or the one this process holds
            for r in range(t) if shared else [rank % t]:
                got = {n: bits(x) for n, x in w.named_tensors(rank=r if shared else 0)}
                want = (
                    {n: bits(x) for n, x in fused.items()}
                    if t == 1
                    else {n: np.asarray(x).view(np.int16) for n, x in ref[r].items()}
                )
                if set(got) != set(want):
                    bad.append(f"T={t} rank {r}: names differ: {sorted(set(got) ^ set(want))[:4]}")
                    continue
                for n in got:
                    if got[n].shape != want[n].shape or not np.array_equal(got[n], want[n]):
                        bad.append(f"T={t} rank {r}: {n} differs")
            del got
        checked.append(t)
        switch.close()
    kind = "qwen3-moe" if args.moe else "qwen3" if args.qk_norm else "qwen2"
    print(
        f"rank {rank}/{world} (tp {coords[0]}, pp {coords[1]}, dp {coords[2]}), {kind}, "
        f"TP={args.tp} PP={args.pp} DP={args.dp} EP={args.ep}: {len(mine)} parameters here; "
        f"rollouts at T in "
        f"{checked}: " + ("all bit-identical" if not bad else f"{len(bad)} MISMATCHES: " + "; ".join(bad[:4]))
    )
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
