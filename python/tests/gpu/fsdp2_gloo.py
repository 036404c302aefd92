"""FSDP2 on CPU tensors (gloo) at W ranks, through the bridge's reference backend: each rank's
`to_local()` must be FSDP2's dim-0 chunk the project assumes (short and empty trailing shards
included), and the rollout bit-identical to torch's bf16 of `full_tensor()`, sliced for T.

    torchrun --nproc_per_node=W python/tests/gpu/fsdp2_gloo.py      (W in 2, 3, 4)

Prints one line per rank; exits non-zero on any mismatch.
"""

import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lifecycle
from lifecycle.sources import _chunks

CONFIG = dict(
    vocab_size=9,  # W = 4: rows 3, 3, 3, 0
    hidden_size=4,  # norms: W = 3 gives rows 2, 2, 0
    intermediate_size=10,  # W = 4: rows 3, 3, 3, 1
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,  # k/v rows 2: W = 3 gives 1, 1, 0; W = 4 gives 1, 1, 0, 0
    head_dim=2,
    max_position_embeddings=32,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def tp_slice(name, full, tp, rank):
    column = ("q_proj", "gate_proj", "up_proj")
    if any(c in name for c in column):
        n = full.shape[0] // tp
        return full[rank * n : (rank + 1) * n]
    if ("o_proj" in name or "down_proj" in name) and full.ndim == 2:
        n = full.shape[1] // tp
        return full[:, rank * n : (rank + 1) * n]
    return full  # kv heads < T, vocabulary 9 at T = 2, norms: replicated


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**CONFIG)
    model = transformers.Qwen2ForCausalLM(cfg).float()
    fully_shard(model, mesh=mesh)
    bad = []
    empty = short = 0
    for name, p in model.named_parameters():
        local = p.to_local()
        lo, hi = _chunks(p.shape[0], world)[rank]
        want = p.full_tensor()[lo:hi]
        if local.shape != want.shape or not torch.equal(local, want):
            bad.append(f"{name}: local {tuple(local.shape)}, rows {lo}..{hi} expected")
        empty += hi == lo
        short += 0 < hi - lo < -(-p.shape[0] // world)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    for tp in [t for t in (1, 2) if world % t == 0]:
        switch = lifecycle.Switch.from_fsdp2(model, rollout_tp=tp)
        for r in range(tp):
            with switch.rollout() as w:
                got = {h.name: torch.from_dlpack(h.bits()).clone() for h in w.handles(r, bits=True)}
            for n, bits in got.items():
                ref = tp_slice(n, full[n], tp, r).to(torch.bfloat16).view(torch.int16)
                if not torch.equal(bits.view(torch.int16), ref.contiguous()):
                    bad.append(f"T={tp} rank {r}: {n} differs from torch's bf16 of full_tensor()")
    print(
        f"rank {rank}/{world}: {len(full)} tensors, {empty} empty and {short} short shards on this "
        f"rank, rollouts at T in {[t for t in (1, 2) if world % t == 0]}: "
        + ("all bit-identical" if not bad else f"{len(bad)} MISMATCHES: " + "; ".join(bad[:4]))
    )
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
