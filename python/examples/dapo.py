"""DAPO that trains a transformer on the GPU, with rollouts through the lifecycle switch.

A small Qwen2 made from a config with `transformers` (no download), wrapped in FSDP2, trained
with real autograd and `torch.optim.AdamW` on verl's DAPO objective (group-normalised
advantages with Bessel's std + 1e-6, token-level clipped loss with clip-higher, dual-clip
c = 3, log-ratio clamped to ±20, token mean), with dynamic sampling: per step, the rollout is
called until enough groups have mixed rewards. Rollouts run on the project's GPU engine on the
switch's rollout weights.

The reward is a rule on the tokens: 1 when at least 4 of the 8 generated tokens t have
t mod 4 == 0 (a uniform policy scores about 0.11).

The same run goes three ways from the same seed and must produce identical samples:
  lazy   `switch.rollout()` switches only when the optimizer changed the weights;
  eager  the switch leaves rollout mode after every call (enters again at the next);
  naive  verl's old path: `full_tensor()` of every parameter copied into a separate rollout
         model on every call, which the engine then reads.
and reports the time each spends switching.

    python python/examples/dapo.py [--steps 12] [--paths lazy,eager,naive]
    torchrun --nproc_per_node=2 python/examples/dapo.py     (FSDP2 W = 2, rollouts at T = 2)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

import lifecycle


def config():
    return transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def reward(tokens: list[int]) -> float:
    return 1.0 if sum(1 for t in tokens if t % 4 == 0) >= 4 else 0.0


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """verl's GRPO outcome advantage: (r - mean) / (std + 1e-6), std with Bessel's correction;
    a group of one sample has mean 0 and std 1 (as verl's `compute_grpo_outcome_advantage`)."""
    if rewards.numel() == 1:
        return rewards / (1.0 + 1e-6)
    return (rewards - rewards.mean()) / (rewards.std() + 1e-6)


def verl_loss(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0):
    """verl's vanilla policy loss with dual-clip, token-mean over `mask`."""
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(l1, l2)
    l3 = -adv * clip_c
    loss = torch.where(adv < 0, torch.minimum(l3, clipped), clipped)
    return (loss * mask).sum() / mask.sum()


def token_logps(model, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """log π(token) of every generated token (positions prompt_len..)."""
    logits = model(input_ids=seqs).logits[:, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)


class NaiveRollout:
    """verl's old path: every call, `full_tensor()` of each parameter into a separate rollout
    model (fp32, not sharded), which a switch of its own gives the engine."""

    def __init__(self, model, cfg, args):
        with torch.device("cuda"):
            self.copy = transformers.Qwen2ForCausalLM(cfg).float()
        self.params = dict(self.copy.named_parameters())
        self.named = list(model.named_parameters())
        self.switch = lifecycle.Switch.from_fsdp2(self.copy, config=cfg)
        self.engine = lifecycle.Engine(
            self.switch, max_sequences=args.prompts * args.group, max_tokens=args.prompt_len + args.new
        )

    def sync(self):
        with torch.no_grad():
            for n, p in self.named:
                self.params[n].copy_(p.full_tensor())


def run(path: str, args) -> dict:
    torch.manual_seed(args.seed)
    cfg = config()
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(cfg).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    naive = NaiveRollout(model, cfg, args) if path == "naive" else None
    if naive is None:
        switch = lifecycle.Switch.from_fsdp2(
            model,
            rollout_tp=dist.get_world_size(),
            switching="eager" if path == "eager" else "lazy",
            optimizer=opt,
        )
        engine = lifecycle.Engine(
            switch, max_sequences=args.prompts * args.group, max_tokens=args.prompt_len + args.new
        )
    else:
        switch, engine = naive.switch, naive.engine
    gen = torch.Generator().manual_seed(args.seed + 1)
    switch_s, calls, curve, samples = 0.0, 0, [], []
    for step in range(args.steps):
        kept, gen_batches, all_r = [], 0, []
        while len(kept) < args.groups and gen_batches < args.max_calls:
            prompts = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len), generator=gen)
            batch = [p.tolist() for p in prompts for _ in range(args.group)]
            t = time.perf_counter()
            if naive is not None:
                naive.sync()
                torch.cuda.synchronize()
            with switch.rollout(refresh=naive is not None) as w:
                switch_s += time.perf_counter() - t
                out = [
                    s.tokens
                    for s in engine.generate(
                        w, batch, max_new_tokens=args.new, temperature=1.0, seed=1000 * step + gen_batches
                    )
                ]
            gen_batches += 1
            calls += 1
            samples.append(out)
            for g in range(args.prompts):
                toks = out[g * args.group : (g + 1) * args.group]
                r = [reward(x) for x in toks]
                all_r += r
                if min(r) != max(r):
                    kept.append((prompts[g].tolist(), toks, r))
        curve.append(sum(all_r) / len(all_r))
        if not kept:
            continue
        kept = kept[: args.groups]
        # the update: nothing is offloaded, so torch trains the shards while the rollout weights
        # stay resident; the optimizer's in-place writes mark them stale for the next rollout
        seqs = torch.tensor(
            [p + x for p, toks, _ in kept for x in toks], device="cuda", dtype=torch.long
        )
        adv = torch.cat([advantages(torch.tensor(r)) for _, _, r in kept]).cuda()[:, None]
        mask = torch.ones(seqs.shape[0], args.new, device="cuda")
        with torch.no_grad():
            old = token_logps(model, seqs, args.prompt_len)
        order = torch.arange(seqs.shape[0])
        for mb in order.chunk(args.minibatches):
            mb = mb.cuda()
            logp = token_logps(model, seqs[mb], args.prompt_len)
            loss = verl_loss(logp, old[mb], adv[mb], mask[mb])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {
        "path": path,
        "curve": curve,
        "calls": calls,
        "switch_s": switch_s,
        "stats": switch.stats(),
        "samples": samples,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--paths", default="lazy,eager,naive")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per gen batch")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--groups", type=int, default=8, help="mixed-reward groups per step")
    ap.add_argument("--max-calls", type=int, default=8, help="gen batches per step at most")
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29551")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    runs = [run(p, args) for p in args.paths.split(",")]
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    base = runs[0]
    print(f"DAPO on a Qwen2 of {sum(p.numel() for p in transformers.Qwen2ForCausalLM(config()).parameters())} "
          f"parameters, FSDP2 W = {dist.get_world_size()}, AdamW lr {args.lr}, verl's loss, {args.steps} steps")
    print(f"{'':24}" + "".join(f"{r['path']:>12}" for r in runs))
    print(f"{'rollout calls':24}" + "".join(f"{r['calls']:>12}" for r in runs))
    print(f"{'switches (enter+refr.)':24}" + "".join(
        f"{r['stats']['enters'] + r['stats']['refreshes']:>12}" for r in runs))
    print(f"{'switch time, run':24}" + "".join(f"{1e3 * r['switch_s']:>10.1f}ms" for r in runs))
    q = max(1, args.steps // 4)
    for r in runs:
        c = r["curve"]
        print(f"{r['path']:>6} learning curve: " + " ".join(f"{x:.3f}" for x in c)
              + f"  (first quarter {sum(c[:q]) / q:.3f} -> last quarter {sum(c[-q:]) / q:.3f})")
    # at W > 1 the naive path's rollout model is one unsharded copy per process (T = 1), whose
    # sums round differently from the T = W group's: its samples are reported, not compared
    world = dist.get_world_size()
    compared = [r for r in runs if world == 1 or r["path"] != "naive"]
    same = all(r["samples"] == base["samples"] for r in compared)
    print(f"identical samples across {', '.join(r['path'] for r in compared)}:", same)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "dapo_py.json"), "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "samples"} for r in runs], f, indent=1)
    c = base["curve"]
    if not same:
        raise SystemExit("the paths' samples differ")
    if sum(c[-q:]) <= sum(c[:q]):
        raise SystemExit("the reward did not rise")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
