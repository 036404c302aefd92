"""DAPO that trains a Megatron-Core model on one GPU, with rollouts through the lifecycle switch.

A small Qwen2-shaped `GPTModel` (Megatron-Core's local spec, RMSNorm, SwiGLU, q/k/v biases) in
`Float16Module` and `DistributedDataParallel` with the distributed optimizer (bf16 parameters,
fp32 main parameters and Adam), as Megatron's `get_model` and `get_megatron_optimizer` build
them; trained with its own autograd and optimizer on the loss every Python example shares
(loss.py beside this file: verl's DAPO objective with truncated importance sampling on the
engine's per-token log-probabilities), with dynamic sampling: per step, the rollout is called
until enough groups have mixed rewards. Rollouts run on the project's GPU engine over
`lifecycle.Switch.from_megatron`: the bf16 parameters read in place where DDP keeps them.

The reward is a rule on the tokens: 1 when at least 4 of the 8 generated tokens t have
t mod 4 == 0 (a uniform policy scores about 0.11).

The same run goes three ways from the same seed and must produce identical samples:
  lazy   `switch.rollout()` switches only when the optimizer stepped (the switch counts the
         steps of the torch optimizer inside Megatron's);
  eager  the switch leaves rollout mode after every call (enters again at the next);
  naive  every parameter copied into a separate model on every call, which a switch of its own
         rereads (`refresh=True`) for the engine.
and reports the time each spends switching.

    python python/examples/dapo_megatron.py [--steps 8] [--paths lazy,eager,naive]
        [--tis-cap 2] [--rollout-dtype bf16|fp8]

Needs `megatron-core` (0.19; `pip install megatron-core`) beside torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

import lifecycle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss import advantages, mismatch, token_logps, verl_loss  # noqa: E402

VOCAB, H, FFN, LAYERS, HEADS, GROUPS, D = 128, 128, 256, 2, 4, 2, 32


def hf_config() -> dict:
    """The Hugging Face config of the model the GPTModel is (what the switch checks it by)."""
    return {
        "model_type": "qwen2",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "head_dim": D,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


def gpt_model(seed: int):
    """A GPTModel of the config above (its weights drawn from `seed`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=D,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=256,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    ).cuda()
    return config, gpt


def trainer(seed: int, lr: float):
    """The GPTModel in Float16Module and DDP with the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config, gpt = gpt_model(seed)
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        Float16Module(config, gpt),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0,
            bf16=True, use_distributed_optimizer=True,
        ),
        [model],
    )
    return model, gpt, opt


class Logits:
    """The model as loss.py's `token_logps` calls it: `.logits` of a batch of token ids."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        logits = self.model(input_ids, pos.expand_as(input_ids), None)
        return SimpleNamespace(logits=logits[..., :VOCAB])


def reward(tokens: list[int]) -> float:
    return 1.0 if sum(1 for t in tokens if t % 4 == 0) >= 4 else 0.0


def padded(rows, width, fill):
    return [list(r) + [fill] * (width - len(r)) for r in rows]


class NaiveRollout:
    """Every call, each parameter copied into a separate GPTModel, which a switch of its own
    rereads for the engine."""

    def __init__(self, gpt, args):
        from megatron.core.transformer.module import Float16Module

        config, copy = gpt_model(args.seed + 7)
        self.copy = Float16Module(config, copy)  # bf16, norms included, as the trainer's
        self.pairs = list(zip(copy.parameters(), gpt.parameters()))
        self.switch = lifecycle.Switch.from_megatron(
            self.copy, None, hf_config(), dtype=args.rollout_dtype
        )
        self.engine = lifecycle.Engine(
            self.switch, max_sequences=args.prompts * args.group,
            max_tokens=args.prompt_len + args.new,
        )

    def sync(self):
        with torch.no_grad():
            for dst, src in self.pairs:
                dst.copy_(src)


def run(path: str, args) -> dict:
    model, gpt, opt = trainer(args.seed, args.lr)
    naive = NaiveRollout(gpt, args) if path == "naive" else None
    if naive is None:
        switch = lifecycle.Switch.from_megatron(
            model, opt, hf_config(), switching="eager" if path == "eager" else "lazy",
            dtype=args.rollout_dtype,
        )
        engine = lifecycle.Engine(
            switch, max_sequences=args.prompts * args.group,
            max_tokens=args.prompt_len + args.new,
        )
    else:
        switch, engine = naive.switch, naive.engine
    gen = torch.Generator().manual_seed(args.seed + 1)
    tis_cap = None if args.tis_cap == 0 else args.tis_cap
    switch_times, calls, curve, samples, mismatches = [], 0, [], [], []

    @contextmanager
    def rollout():
        t = time.perf_counter()
        if naive is not None:
            naive.sync()
            torch.cuda.synchronize()
        with switch.rollout(refresh=naive is not None) as w:
            switch_times.append(time.perf_counter() - t)
            yield w

    for step in range(args.steps):
        kept, gen_batches, all_r = [], 0, []
        while len(kept) < args.groups and gen_batches < args.max_calls:
            prompts = torch.randint(0, VOCAB, (args.prompts, args.prompt_len), generator=gen)
            batch = [p.tolist() for p in prompts for _ in range(args.group)]
            with rollout() as w:
                got = engine.generate(
                    w, batch, max_new_tokens=args.new, temperature=1.0,
                    seed=1000 * step + gen_batches,
                )
            gen_batches += 1
            calls += 1
            samples.append([s.tokens for s in got])
            for g in range(args.prompts):
                group = got[g * args.group : (g + 1) * args.group]
                toks = [s.tokens for s in group]
                r = [reward(x) for x in toks]
                all_r += r
                if min(r) != max(r):
                    kept.append((prompts[g].tolist(), toks, r, [s.logprobs.tolist() for s in group]))
        curve.append(sum(all_r) / len(all_r))
        if not kept:
            mismatches.append(None)
            continue
        kept = kept[: args.groups]
        seqs = torch.tensor(
            padded([p + x for p, ts, _, _ in kept for x in ts], args.prompt_len + args.new, 0),
            device="cuda",
        )
        toks = [x for _, ts, _, _ in kept for x in ts]
        mask = torch.tensor(padded([[1.0] * len(x) for x in toks], args.new, 0.0), device="cuda")
        rollout_logp = torch.tensor(
            padded([lp for _, _, _, lps in kept for lp in lps], args.new, 0.0), device="cuda"
        )
        adv = torch.cat([advantages(torch.tensor(r)) for _, _, r, _ in kept]).cuda()[:, None]
        policy = Logits(model)
        with torch.no_grad():
            old = token_logps(policy, seqs, args.prompt_len)
        delta, kl = mismatch(old, rollout_logp, mask)
        mismatches.append({"mean_abs_dlogp": delta, "kl_k3": kl})
        print(
            f"[{path}] step {step + 1}: mean reward {curve[-1]:.3f}, {len(kept)} groups kept, "
            f"rollout vs trainer log-probs: mean |d logp| {delta:.3e}, KL k3 {kl:.3e}",
            flush=True,
        )
        for mb in torch.arange(seqs.shape[0]).chunk(args.minibatches):
            mb = mb.cuda()
            logp = token_logps(policy, seqs[mb], args.prompt_len)
            loss = verl_loss(logp, old[mb], adv[mb], mask[mb], rollout_logp=rollout_logp[mb], tis_cap=tis_cap)
            loss.backward()
            model.finish_grad_sync()
            opt.step()
            opt.zero_grad()
            model.zero_grad_buffer()
    return {
        "path": path,
        "curve": curve,
        "calls": calls,
        "first_switch_s": switch_times[0] if switch_times else 0.0,
        "later_switch_s": sum(switch_times[1:]),
        "stats": switch.stats(),
        "samples": samples,
        "mismatch": mismatches,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
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
    ap.add_argument("--tis-cap", type=float, default=2.0, help="truncated importance sampling cap (0: off)")
    ap.add_argument("--rollout-dtype", choices=["bf16", "fp8"], default="bf16")
    args = ap.parse_args()

    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    results = [run(p, args) for p in args.paths.split(",")]
    print("\npath   calls  switches (enter+refresh)  first switch  later switches  reward first -> last")
    for r in results:
        s = r["stats"]
        print(
            f"{r['path']:6} {r['calls']:5}  {s['enters'] + s['refreshes']:24}  "
            f"{r['first_switch_s'] * 1e3:9.1f} ms  {r['later_switch_s'] * 1e3:11.1f} ms  "
            f"{r['curve'][0]:.3f} -> {r['curve'][-1]:.3f}"
        )
    same = all(r["samples"] == results[0]["samples"] for r in results[1:])
    print(f"samples identical across {', '.join(r['path'] for r in results)}: {same}")
    learned = results[0]["curve"][-1] > results[0]["curve"][0]
    print(f"the reward rose: {learned}")
    dist.destroy_process_group()
    if not same or not learned:
        sys.exit(1)


if __name__ == "__main__":
    main()
