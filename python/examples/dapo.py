"""DAPO that trains a transformer on the GPU, with rollouts through the lifecycle switch.

A small Qwen2 made from a config with `transformers` (no download), wrapped in FSDP2, trained
with real autograd and `torch.optim.AdamW` on verl's DAPO objective (group-normalised
advantages with Bessel's std + 1e-6, token-level clipped loss with clip-higher, dual-clip
c = 3, log-ratio clamped to ±20, token mean; the loss is loss.py's, beside this file), with
dynamic sampling: per step, the rollout is called until enough groups have mixed rewards.
Rollouts run on the project's GPU engine on the switch's rollout weights, and return each
token's log-probability there (bf16 weights, the engine's kernels): verl's truncated importance
sampling weighs each token's loss by min(exp(trainer log-prob - rollout log-prob), C)
(`--tis-cap C`, 2 by default; `--tis-cap 0` or `--no-tis` turns it off), and every step prints
the mismatch between the two (mean |d logp| and the k3 estimate of KL(rollout || trainer)).

With `--sampling stream` the dynamic sampling is streamed (`lifecycle.GroupStream`): groups are
submitted as the engine's slots free up, each is scored as soon as its samples finish, and the
rollout stops once `--groups` are kept; the rest are aborted, or carried into the next step as
partial rollouts (`--leftovers partial`) that continue on the updated weights.

The reward is a rule on the tokens: 1 when at least 4 of the 8 generated tokens t have
t mod 4 == 0 (a uniform policy scores about 0.11).

With `--lora R` the policy is a PEFT LoRA model (rank R, `lora_alpha` 2R, on all seven linear
types; `Switch.from_peft`, one process): the base is frozen and cast into the rollout once, a
refresh after an update moves the adapters alone, and the engine applies them unmerged.

The same run goes three ways from the same seed and must produce identical samples:
  lazy   `switch.rollout()` switches only when the optimizer changed the weights;
  eager  the switch leaves rollout mode after every call (enters again at the next);
  naive  verl's old path: `full_tensor()` of every parameter copied into a separate rollout
         model on every call, which the engine then reads (with `--lora`, a second PEFT model
         whose base and adapters are copied and cast every call; merging the adapters into the
         base instead would round differently, so its samples could not be compared).
and reports the time each spends switching.

    python python/examples/dapo.py [--steps 12] [--paths lazy,eager,naive] [--tis-cap 2]
        [--rollout-dtype bf16|fp8 --fp8-compute w8a8|weight-only]
        [--sampling batches|stream --leftovers abort|partial] [--lora R]
    torchrun --nproc_per_node=2 python/examples/dapo.py     (FSDP2 W = 2, rollouts at T = 2)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

import lifecycle

# loss.py sits beside this script: `python dapo.py` and torchrun put this folder on the path; a
# loader that runs the file from elsewhere (importlib) may not
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss import advantages, mismatch, token_logps, verl_loss  # noqa: E402


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


def padded(rows, width, fill):
    """`rows` (lists or arrays of at most `width` items) as a (len(rows), width) list of lists,
    each row filled up with `fill`."""
    return [list(r) + [fill] * (width - len(r)) for r in rows]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(cfg, rank: int):
    """A PEFT LoRA model over a fresh Qwen2 of `cfg` (rank `rank`, `lora_alpha` 2 rank, every
    linear type; PEFT's start: B = 0)."""
    import peft

    with torch.device("cuda"):
        base = transformers.Qwen2ForCausalLM(cfg).float()
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0)
    return peft.get_peft_model(base, lora)


def policy(cfg, args):
    """The trained model: FSDP2 over a Qwen2, or a PEFT LoRA model with `--lora`."""
    if args.lora:
        return lora_model(cfg, args.lora)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(cfg).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


class NaiveRollout:
    """verl's old path: every call, `full_tensor()` of each parameter into a separate rollout
    model (fp32, not sharded), which a switch of its own gives the engine. With `--lora` the
    copy is a second PEFT model that receives every parameter, base and adapters, every call;
    its switch leaves rollout mode after each call, so each call casts all of it (a refresh
    would refuse the written base by design)."""

    def __init__(self, model, cfg, args):
        if args.lora:
            self.copy = lora_model(cfg, args.lora)
            self.switch = lifecycle.Switch.from_peft(self.copy, switching="eager")
        else:
            with torch.device("cuda"):
                self.copy = transformers.Qwen2ForCausalLM(cfg).float()
            self.switch = lifecycle.Switch.from_fsdp2(self.copy, config=cfg, dtype=args.rollout_dtype)
        self.params = dict(self.copy.named_parameters())
        self.named = list(model.named_parameters())
        self.engine = lifecycle.Engine(
            self.switch, max_sequences=args.prompts * args.group, max_tokens=args.prompt_len + args.new,
            fp8_compute=args.fp8_compute,
        )

    def sync(self):
        with torch.no_grad():
            for n, p in self.named:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                self.params[n].copy_(full)


def run(path: str, args) -> dict:
    torch.manual_seed(args.seed)
    cfg = config()
    model = policy(cfg, args)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
    naive = NaiveRollout(model, cfg, args) if path == "naive" else None
    switching = "eager" if path == "eager" else "lazy"
    if naive is None:
        if args.lora:
            switch = lifecycle.Switch.from_peft(model, switching=switching, optimizer=opt)
        else:
            switch = lifecycle.Switch.from_fsdp2(
                model,
                rollout_tp=dist.get_world_size(),
                switching=switching,
                optimizer=opt,
                dtype=args.rollout_dtype,
            )
        engine = lifecycle.Engine(
            switch, max_sequences=args.prompts * args.group, max_tokens=args.prompt_len + args.new,
            fp8_compute=args.fp8_compute,
        )
    else:
        switch, engine = naive.switch, naive.engine
    gen = torch.Generator().manual_seed(args.seed + 1)
    switch_times, calls, curve, samples, mismatches = [], 0, [], [], []
    tis_cap = None if args.no_tis or args.tis_cap == 0 else args.tis_cap
    rank0 = dist.get_rank() == 0
    stream = None
    if args.sampling == "stream":
        stream = lifecycle.GroupStream(
            engine, args.group, max_new_tokens=args.new, temperature=args.temperature,
            seed=args.seed + 1, leftovers=args.leftovers,
            max_staleness=args.max_staleness if args.leftovers == "partial" else None,
            max_groups=args.max_calls * args.prompts,
        )

    @contextmanager
    def rollout():
        # a rollout session, its switch timed (the naive path copies every parameter first)
        t = time.perf_counter()
        if naive is not None:
            naive.sync()
            torch.cuda.synchronize()
        with switch.rollout(refresh=naive is not None) as w:
            switch_times.append(time.perf_counter() - t)
            yield w

    def prompt_of(g: int) -> list[int]:
        # group g's prompt, the same whichever step and path draws it
        p = torch.Generator().manual_seed(1_000_003 * (args.seed + 1) + g)
        return torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=p).tolist()

    for step in range(args.steps):
        kept, gen_batches, all_r = [], 0, []
        if stream is not None:
            # DAPO's dynamic sampling streamed: groups submitted as slots free up, each scored
            # when its samples finish, generation stopped once --groups are kept
            def keep(g, group):
                r = [reward(s.tokens) for s in group]
                all_r.extend(r)
                return min(r) != max(r)

            with rollout() as w:
                filled = stream.fill(w, args.groups, group=prompt_of, keep=keep)
            calls += 1
            samples.append([[s.tokens for s in ss] for _, ss in filled.kept])
            kept = [
                (prompt_of(g), [s.tokens for s in ss], [reward(s.tokens) for s in ss],
                 [s.logprobs.tolist() for s in ss])
                for g, ss in filled.kept
            ]
            if rank0:
                print(
                    f"[{path}] step {step + 1} stream: {filled.finished} samples finished "
                    f"(mean {filled.finished_mean_len:.1f} tokens; kept {filled.kept_mean_len:.1f}), "
                    f"{filled.aborted} aborted, {filled.carried} carried, {filled.stale} stale",
                    flush=True,
                )
        while stream is None and len(kept) < args.groups and gen_batches < args.max_calls:
            prompts = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len), generator=gen)
            batch = [p.tolist() for p in prompts for _ in range(args.group)]
            with rollout() as w:
                got = engine.generate(
                    w, batch, max_new_tokens=args.new, temperature=args.temperature,
                    seed=1000 * step + gen_batches,
                )
            out = [s.tokens for s in got]
            gen_batches += 1
            calls += 1
            samples.append(out)
            for g in range(args.prompts):
                group = got[g * args.group : (g + 1) * args.group]
                toks = [s.tokens for s in group]
                r = [reward(x) for x in toks]
                all_r += r
                if min(r) != max(r):
                    # the rollout's log-probability of every token (the engine's weights)
                    kept.append((prompts[g].tolist(), toks, r, [s.logprobs.tolist() for s in group]))
        curve.append(sum(all_r) / len(all_r))
        if not kept:
            mismatches.append(None)
            continue
        kept = kept[: args.groups]
        # the update: nothing is offloaded, so torch trains the shards while the rollout weights
        # stay resident; the optimizer's in-place writes mark them stale for the next rollout.
        # Samples shorter than --new (none without stop tokens) are padded and masked out.
        toks = [x for _, ts, _, _ in kept for x in ts]
        seqs = torch.tensor(
            padded([p + x for p, ts, _, _ in kept for x in ts], args.prompt_len + args.new, 0),
            device="cuda",
            dtype=torch.long,
        )
        mask = torch.tensor(padded([[1.0] * len(x) for x in toks], args.new, 0.0), device="cuda")
        rollout_logp = torch.tensor(
            padded([lp for _, _, _, lps in kept for lp in lps], args.new, 0.0), device="cuda"
        )
        adv = torch.cat([advantages(torch.tensor(r)) for _, _, r, _ in kept]).cuda()[:, None]
        with torch.no_grad():
            # π_old: the trainer's fp32 weights before the first optimizer step
            old = token_logps(model, seqs, args.prompt_len, args.temperature)
        delta, kl = mismatch(old, rollout_logp, mask)
        mismatches.append({"mean_abs_dlogp": delta, "kl_k3": kl})
        if rank0:
            print(
                f"[{path}] step {step + 1}: mean reward {curve[-1]:.3f}, {len(kept)} groups kept, "
                f"rollout vs trainer log-probs: mean |d logp| {delta:.3e}, KL k3 {kl:.3e}",
                flush=True,
            )
        order = torch.arange(seqs.shape[0])
        for mb in order.chunk(args.minibatches):
            mb = mb.cuda()
            logp = token_logps(model, seqs[mb], args.prompt_len, args.temperature)
            loss = verl_loss(logp, old[mb], adv[mb], mask[mb], rollout_logp=rollout_logp[mb], tis_cap=tis_cap)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {
        "path": path,
        "curve": curve,
        "calls": calls,
        "switch_s": sum(switch_times),
        # the first switch of a path also builds what later ones reuse (kernels compiled once per
        # process, buffers), so it is reported apart
        "first_switch_s": switch_times[0] if switch_times else 0.0,
        "later_switch_s": sum(switch_times[1:]),
        "stats": switch.stats(),
        # bf16 bytes a refresh after an update moves: the trained parameters (with a frozen base,
        # the adapters alone), or for the naive path every parameter, copied first
        "refresh_bytes": 2 * sum(
            p.numel() for p in (model.parameters() if naive is not None else trained)
        ),
        "samples": samples,
        "mismatch": mismatches,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--paths", default=None, help="lazy,eager,naive")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per gen batch")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--groups", type=int, default=8, help="mixed-reward groups per step")
    ap.add_argument("--max-calls", type=int, default=8, help="gen batches per step at most")
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument(
        "--tis-cap", type=float, default=2.0,
        help="truncated importance sampling: each token's loss times min(exp(trainer log-prob - "
        "rollout log-prob), C) with C this cap (verl's tis_imp_ratio_cap); 0 turns it off",
    )
    ap.add_argument("--no-tis", action="store_true", help="no truncated importance sampling (--tis-cap 0)")
    ap.add_argument("--rollout-dtype", choices=["bf16", "fp8"], default="bf16", help="rollout weights")
    ap.add_argument(
        "--fp8-compute", choices=["w8a8", "weight-only"], default="w8a8",
        help="fp8 products: w8a8 (the fast mode) or weight-only (the exact mode)",
    )
    ap.add_argument(
        "--sampling", choices=["batches", "stream"], default="batches",
        help="dynamic sampling by whole gen batches of --prompts groups, or streamed (groups "
        "submitted as the engine's slots free up, each scored as it finishes)",
    )
    ap.add_argument(
        "--leftovers", choices=["abort", "partial"], default="abort",
        help="with --sampling stream: the requests in flight once the groups are kept are aborted "
        "(which favours short samples), or carried as partial rollouts into the next step",
    )
    ap.add_argument("--max-staleness", type=int, default=1, help="weight versions a partial rollout may lag")
    ap.add_argument(
        "--lora", type=int, default=0, metavar="R",
        help="train PEFT LoRA adapters of rank R on every linear type (one process; bf16 rollout)",
    )
    args = ap.parse_args()
    if args.paths is None:
        args.paths = "lazy,eager,naive"
    if args.lora < 0:
        ap.error(f"--lora must be a rank >= 1 (0: no adapters), got {args.lora}")
    if args.lora and args.rollout_dtype != "bf16":
        ap.error("--lora takes a bf16 rollout (--rollout-dtype bf16): a frozen base is not refreshed in fp8")
    if not (args.tis_cap >= 0 and args.tis_cap < float("inf")):
        ap.error(f"--tis-cap must be a finite number >= 0 (0 turns TIS off), got {args.tis_cap}")
    if not (args.temperature >= 0 and args.temperature < float("inf")):
        ap.error(f"--temperature must be a finite number >= 0 (0 is greedy), got {args.temperature}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29551")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.lora and dist.get_world_size() > 1:
        raise SystemExit("--lora runs in one process (the PEFT model is not sharded here)")
    runs = [run(p, args) for p in args.paths.split(",")]
    if dist.get_rank() != 0:
        dist.destroy_process_group()
        return
    base = runs[0]
    tis = "off" if args.no_tis or args.tis_cap == 0 else f"capped at {args.tis_cap}"
    print(f"DAPO on a Qwen2 of {sum(p.numel() for p in transformers.Qwen2ForCausalLM(config()).parameters())} "
          "parameters"
          + (", one process" if args.lora else f", FSDP2 W = {dist.get_world_size()}")
          + f", AdamW lr {args.lr}, verl's loss, "
          f"truncated importance sampling {tis}, {args.steps} steps; {args.rollout_dtype} rollout"
          + (f" ({args.fp8_compute})" if args.rollout_dtype == "fp8" else "")
          + (f", dynamic sampling streamed ({args.leftovers})" if args.sampling == "stream" else "")
          + (f", LoRA r = {args.lora} on every linear type (adapters unmerged in the engine)"
             if args.lora else ""))
    print(f"{'':24}" + "".join(f"{r['path']:>12}" for r in runs))
    print(f"{'rollout calls':24}" + "".join(f"{r['calls']:>12}" for r in runs))
    print(f"{'switches (enter+refr.)':24}" + "".join(
        f"{r['stats']['enters'] + r['stats']['refreshes']:>12}" for r in runs))
    print(f"{'first switch':24}" + "".join(f"{1e3 * r['first_switch_s']:>10.1f}ms" for r in runs))
    print(f"{'switch time, the rest':24}"
          + "".join(f"{1e3 * r['later_switch_s']:>10.1f}ms" for r in runs))
    print(f"{'bytes a refresh moves':24}" + "".join(f"{r['refresh_bytes'] / 1e6:>10.2f}MB" for r in runs))
    print("  (the first switch of the process also compiles its kernels: it falls on the first path)")
    q = max(1, args.steps // 4)
    for r in runs:
        c = r["curve"]
        print(f"{r['path']:>6} learning curve: " + " ".join(f"{x:.3f}" for x in c)
              + f"  (first quarter {sum(c[:q]) / q:.3f} -> last quarter {sum(c[-q:]) / q:.3f})")
        m = [x for x in r["mismatch"] if x is not None]
        if m:
            print(f"{r['path']:>6} rollout vs trainer: mean |d logp| "
                  f"{sum(x['mean_abs_dlogp'] for x in m) / len(m):.3e}, KL k3 "
                  f"{sum(x['kl_k3'] for x in m) / len(m):.3e} (mean over {len(m)} steps)")
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
