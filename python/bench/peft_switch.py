"""What a switch of a PEFT LoRA model costs at 7.6B shapes: `Switch.from_peft` over a transformers
Qwen2 (Qwen2.5-7B shapes, random) with adapters of rank 64 on all seven linear types, on one GPU.
The base fp32 (`--base fp32`, the default: the switch casts it once into its own bf16 copy) or
bf16 (`--base bf16`, as PEFT users load it: the rollout reads it in place, so the device holds it
once); PEFT keeps the adapters f32 either way.

    python python/bench/peft_switch.py [--model 7b|1.5b] [--base fp32|bf16] [--rank 64] [--iters 5]

Each iteration takes an AdamW step on the adapters (random gradients: the switch does not care
where they come from), then enters rollout mode: the refresh moves the adapters alone. Reported:
the first enter (the base cast once), each refresh's time inside the switch and Python's wall time
around it (the version reads of every tensor included), the bf16 bytes a refresh writes, and, in
the same run, a written base weight refused by name, then the enter after it, which casts every
tensor: what a full switch of the model costs (a bf16 base read in place is refused by name
once, then read as written: nothing to cast). The engine on the adapters unmerged, then merged
(its wake merges them into a private copy of the rollout weights: the difference of the two
wakes estimates the merge). Device memory (used, from `cudaMemGetInfo`) after each stage. Prints one JSON object (and writes it to $OUT/peft_switch.json when OUT is set).
"""

import argparse
import json
import os
import statistics
import time

import peft
import torch
import transformers

import lifecycle

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def used_gb() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 1e9, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--base", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    mem = {"start": used_gb()}
    config = transformers.Qwen2Config(
        **SHAPES[args.model], rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    with torch.device("cuda"):
        base = transformers.Qwen2ForCausalLM(config)
        base = base.float() if args.base == "fp32" else base.to(torch.bfloat16)
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                           lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4)

    def adapter_step():
        for p in trainable:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.zero_grad(set_to_none=False)

    adapter_step()  # the optimizer's state exists from here on
    mem["trainer: base, adapters, their grads and AdamW state"] = used_gb()
    res = {
        "model": args.model,
        "rank": args.rank,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peft": peft.__version__,
        "base_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "adapter_params": sum(p.numel() for p in trainable),
        "adapter_dtype": str(trainable[0].dtype),
        "base_dtype": args.base,
    }
    # the bf16 a refresh writes: every adapter matrix
    res["refresh_bytes"] = 2 * res["adapter_params"]

    switch = lifecycle.Switch.from_peft(model)
    t = time.perf_counter()
    with switch.rollout():
        pass
    res["first_enter_wall_ms"] = 1e3 * (time.perf_counter() - t)
    res["first_enter_ms"] = 1e3 * switch.last_enter[2]
    held = ("its own bf16 base and the adapters" if args.base == "fp32"
            else "the adapters: the bf16 base read in place")
    mem[f"+ rollout weights ({held})"] = used_gb()

    inside, wall = [], []
    for _ in range(args.iters):
        adapter_step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with switch.rollout():
            pass
        wall.append(1e3 * (time.perf_counter() - t))
        inside.append(1e3 * switch.last_enter[2])
    stats = switch.stats()
    assert (stats["enters"], stats["refreshes"]) == (1, args.iters), stats
    res["refresh_ms"] = [round(x, 3) for x in inside]
    res["refresh_wall_ms"] = [round(x, 3) for x in wall]
    res["refresh_ms_median"] = statistics.median(inside)
    res["refresh_wall_ms_median"] = statistics.median(wall)

    # the engine on the unmerged adapters, its KV cache made by a first generation, then in the
    # merged mode (a private copy of the rollout weights, the adapters merged at its wake): each
    # generation twice, the first after the engine's wake (the merge included), the second not
    prompts = [[1, 2, 3, 4]] * 16
    # the merged mode writes a private copy of the base: not with a base read in place
    modes = ("unmerged", "merged") if args.base == "fp32" else ("unmerged",)
    for mode in modes:
        engine = lifecycle.Engine(switch, max_sequences=16, max_tokens=2048, lora_mode=mode)
        with switch.rollout() as w:
            times = []
            for _ in range(2):
                t = time.perf_counter()
                engine.generate(w, prompts, max_new_tokens=32)
                times.append(time.perf_counter() - t)
        res[f"generate_16x32_{mode}_s"] = [round(x, 4) for x in times]
        mem[f"+ the engine ({mode}) and its KV cache (16 sequences x 2048 tokens)"] = used_gb()
        del engine
    wake = {m: res[f"generate_16x32_{m}_s"][0] - res[f"generate_16x32_{m}_s"][1] for m in modes}
    if "merged" in wake:
        # the merge: what the merged engine's wake costs beyond the unmerged one's
        res["merge_ms_estimate"] = 1e3 * (wake["merged"] - wake["unmerged"])

    # a base weight written: refused by name, nothing moved; the next enter casts everything
    weight = model.base_model.model.model.layers[3].mlp.down_proj.base_layer.weight
    with torch.no_grad():
        weight.mul_(1.5)
    try:
        with switch.rollout():
            pass
        res["written_base"] = "NOT refused"
    except lifecycle.LifecycleError as e:
        res["written_base"] = f"refused: {e}"
    t = time.perf_counter()
    with switch.rollout() as w:
        got = dict(w.named_tensors())["model.layers.3.mlp.down_proj.weight"]
        # cast again (an fp32 base), or read in place as written (a bf16 base)
        res["written_base_cast_again"] = bool(torch.equal(got, weight.detach().to(torch.bfloat16)))
        del got  # a view of the rollout weights: close refuses while it is referenced
    res["full_enter_wall_ms"] = 1e3 * (time.perf_counter() - t)
    res["full_enter_ms"] = 1e3 * switch.last_enter[2]
    res["stats"] = switch.stats()
    switch.close()
    res["memory_used_gb"] = mem
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "peft_switch.json"), "w") as f:
            json.dump(res, f, indent=1)
    ok = res["written_base"].startswith("refused") and res["written_base_cast_again"]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
