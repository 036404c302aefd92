"""PyTorch peer of the GPU rollout engine's steady-state comparison (bench/src/bin/rollout_bench.rs):
Hugging Face transformers `generate` with a static KV cache under `torch.compile`, one GPU, on the
rollout benchmark's shapes and lengths: Qwen2.5-7B shapes at `--layers` decoder layers (hidden 3584,
intermediate 18944, 28 heads, 4 kv heads, vocab 152064, rope_theta 1e6, rms eps 1e-6, untied
embeddings), bf16, random init; random prompts of `--prompt` tokens; temperature-1 sampling (no
top-k, no top-p) with no stop token, exactly `--new` tokens per sequence.

Compilation is the transformers 5.x documented way: a fixed-size cache (`cache_implementation=
"static"`) makes `generate` compile the model's forward for the decode steps itself (the prefill
stays eager), configured by a `CompileConfig` passed to `generate` (mode "reduce-overhead": CUDA
graphs). We do not call `torch.compile(model.forward)` ourselves: the 5.x docs advise against
compiling outside `generate`. Tried in order: `CompileConfig(fullgraph=True)`, then transformers'
default `CompileConfig()` (graph breaks allowed), then eager; a failure is printed on one line.

Per batch size: a warm-up generate at the same batch and lengths (compilation included, printed),
then one timed generate: tokens/s = batch x new / time and ms/step = time / new, prefill
included (as rollout_bench's steady state counts it). Prefill excluded: the time of a 1-token
generate (the prefill and one sampled token) is subtracted, over the remaining new - 1 steps.
`--eager` also times the same static-cache generate without compile (sdpa attention).

Run on the GPU machine (PyTorch + transformers installed, no network needed):
    python3 models/decoder-gpu/bench/hf_rollout.py --layers 4 --batches 1,2,4,8,16,32,64 --eager
"""
import argparse
import time

import torch
import transformers
from transformers import CompileConfig, Qwen2Config, Qwen2ForCausalLM


def build(layers):
    cfg = Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
        num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
        max_position_embeddings=32768, use_sliding_window=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    return model


def generate(model, ids, new, **mode):
    """Seconds of one `generate` of exactly `new` sampled tokens per sequence."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                         cache_implementation="static", pad_token_id=0, **mode)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    if out.shape != (ids.shape[0], ids.shape[1] + new):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected "
                           f"{(ids.shape[0], ids.shape[1] + new)}")
    return secs


def one_line(e):
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def graphs():
    try:  # a private counter: -1 where absent
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    except Exception:
        return -1


def run(model, ids, new, label, mode):
    """Warm up, then time; returns False if the warm-up raised (the mode is then given up)."""
    b = ids.shape[0]
    torch.compiler.reset()
    if hasattr(model, "_compiled_call"):
        del model._compiled_call  # compile afresh at this batch (and keep under the recompile limit)
    g0, stage = graphs(), "warm-up"
    try:
        warm = generate(model, ids, new, **mode)
        stage = "timed run"
        secs = generate(model, ids, new, **mode)
        pre = min(generate(model, ids, 1, **mode) for _ in range(2))
    except Exception as e:
        print(f"batch {b:3}, {label}: FAILED in the {stage}, {one_line(e)}", flush=True)
        return stage != "warm-up" or isinstance(e, torch.cuda.OutOfMemoryError)
    eager = "disable_compile" in mode
    note = "" if eager or hasattr(model, "_compiled_call") else " [generate did NOT compile: eager]"
    dec = secs - pre
    print(f"batch {b:3}, {label}{note}: warm-up {warm:.1f} s ({graphs() - g0} dynamo graphs); "
          f"{new} new: {secs:.3f} s, {b * new / secs:.0f} tokens/s, {1e3 * secs / new:.2f} ms/step "
          f"incl. prefill; prefill (1-token generate) {1e3 * pre:.1f} ms; decode only: "
          f"{b * (new - 1) / dec:.0f} tokens/s, {1e3 * dec / (new - 1):.2f} ms/step; peak "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="also time without compile")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.new < 2 or args.prompt < 1 or not batches:
        ap.error("--new must be at least 2, --prompt at least 1, --batches non-empty")
    try:
        import triton
        tri = f"triton {triton.__version__}"
    except Exception as e:
        tri = f"no triton ({one_line(e)})"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
          f"{transformers.__version__}, {tri}, {torch.cuda.get_device_name()}", flush=True)

    model = build(args.layers)
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    emb, head = model.model.embed_tokens.weight.numel(), model.lm_head.weight.numel()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * (
        args.prompt + args.new) * max(batches)  # K and V, bf16
    print(f"model: Qwen2.5-7B shapes, {args.layers} layers, {model.dtype}, random init, "
          f"{cfg._attn_implementation} attention, rope {getattr(cfg, 'rope_parameters', None)}: "
          f"{total / 1e9:.3f} B params (embedding {emb / 1e9:.3f} B, head {head / 1e9:.3f} B, "
          f"layers + norm {(total - emb - head) / 1e9:.3f} B), {2 * total / 2**30:.2f} GiB; "
          f"static KV cache at batch {max(batches)} x {args.prompt + args.new} positions: "
          f"{kv / 2**20:.0f} MiB", flush=True)
    print(f"sampling: temperature 1, no top-k/top-p, no stop token; prompt {args.prompt}, "
          f"{args.new} new tokens per sequence", flush=True)

    ladder = [("compiled (fullgraph)", {"compile_config": CompileConfig(fullgraph=True)}),
              ("compiled (CompileConfig default, graph breaks allowed)",
               {"compile_config": CompileConfig()}),
              ("eager (compile failed: fallback)", {"disable_compile": True})]
    torch.manual_seed(0)
    try:  # the generate call itself, eager and tiny, so that a failure here is not blamed on compile
        generate(model, torch.zeros(1, 8, dtype=torch.long, device="cuda"), 2, disable_compile=True)
    except Exception as e:
        raise SystemExit(f"generate (eager smoke test) FAILED: {one_line(e)}")
    for b in batches:
        ids = torch.randint(0, cfg.vocab_size, (b, args.prompt), device="cuda")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        while ladder and not run(model, ids, args.new, *ladder[0]):
            ladder.pop(0)  # this mode failed: use the next one from now on
            if ladder:
                print(f"  falling back to: {ladder[0][0]}", flush=True)
        if args.eager:
            run(model, ids, args.new, "eager (sdpa, static cache, no compile)",
                {"disable_compile": True})


if __name__ == "__main__":
    main()
