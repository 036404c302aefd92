"""``Switch.from_peft`` over a PEFT LoRA model on the GPU (a transformers Qwen2 under
``peft.get_peft_model``): the rollout holds the bf16 of the base and of the adapters under the
model's names, a refresh after an optimizer step on the adapters moves the adapters alone, a
written base weight is refused by name and cast again by the next rollout,
``named_tensors("peft")`` gives the adapters under PEFT's keys, and the engine on the unmerged
adapters, and in its merged mode, agrees with PEFT's merged model."""

import pytest

from gpu_support import qwen2_config, torch, transformers

peft = pytest.importorskip("peft")

import lifecycle  # noqa: E402
from lifecycle._lora import peft_name  # noqa: E402

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def peft_model(seed=0):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        base = transformers.Qwen2ForCausalLM(qwen2_config()).float()
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # PEFT starts B at zero: draw it, so that every adapter shows
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    return model


def bf16_of(model) -> dict:
    """The bf16 of every parameter under the switch's names."""
    return {peft_name(n): p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def same(got: dict, want: dict, names) -> list:
    return [n for n in names if not torch.equal(got[n].view(torch.int16), want[n].view(torch.int16))]


def test_from_peft_refreshes_the_adapters_alone_and_refuses_a_written_base():
    model = peft_model()
    switch = lifecycle.Switch.from_peft(model)
    want = bf16_of(model)
    adapters = [n for n in want if ".lora_" in n]
    assert len(adapters) == 2 * len(TARGETS) * 2  # A and B, 4 modules, 2 layers
    with switch.rollout() as w:
        got = {n: t.clone() for n, t in w.named_tensors()}
        peft_keys = sorted(n for n, _ in w.named_tensors("peft"))
    assert set(got) == set(want)
    assert same(got, want, want) == []
    assert peft_keys == sorted("base_model.model." + n for n in adapters)
    enter_s = switch.last_enter[2]

    # an optimizer step on the adapters while the rollout weights stay resident (no train():
    # leaving rollout mode releases them, and the next rollout enters anew): the refresh moves
    # the adapters alone
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    model(ids).logits.float().square().mean().backward()
    opt.step()
    after = bf16_of(model)
    moved = [n for n in adapters if not torch.equal(after[n], want[n])]
    assert moved, "the step changed the adapters"
    with switch.rollout() as w:
        got = {n: t.clone() for n, t in w.named_tensors()}
    assert same(got, after, after) == []
    stats = switch.stats()
    assert (stats["enters"], stats["refreshes"]) == (1, 1), stats
    refresh_s = switch.last_enter[2]
    print(
        f"from_peft: enter {enter_s * 1e3:.3f} ms, adapter refresh {refresh_s * 1e3:.3f} ms "
        f"({len(moved)} of {len(adapters)} adapter matrices changed)"
    )

    # a written base weight: the refresh refuses it by name, then the next rollout casts every
    # tensor again
    base = model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight
    with torch.no_grad():
        base.add_(1.0)
    with pytest.raises(lifecycle.LifecycleError, match=r"layers\.1\.self_attn\.q_proj\.weight.*frozen"):
        with switch.rollout():
            pass
    with switch.rollout() as w:
        got = {n: t.clone() for n, t in w.named_tensors()}
    assert same(got, bf16_of(model), got) == []
    switch.close()


def test_from_peft_refuses_what_it_does_not_switch():
    def base():
        return transformers.Qwen2ForCausalLM(qwen2_config()).float().cuda()

    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(lifecycle.ConfigError, match="modules_to_save"):
        lifecycle.Switch.from_peft(peft.get_peft_model(base(), cfg))
    with pytest.raises(lifecycle.ConfigError, match="no LoRA adapter `default`"):
        lifecycle.Switch.from_peft(base())


def test_the_engine_on_unmerged_adapters_is_pefts_merged_model():
    """A consumer no one here wrote: PEFT's ``merge_and_unload()`` of the model and the engine on
    the unmerged adapters, teacher-forced on the engine's sampled tokens. The model's
    parameters are rounded to bf16 first, so the merged f32 model and the rollout hold the same
    numbers (``W + s·B·A`` in f32 of bf16 base and adapters); with the f32 KV cache each
    token's log-probability agrees within 1e-3, greedy tokens are equal, and the base alone is
    far from both."""
    np = pytest.importorskip("numpy")
    model = peft_model(seed=4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    switch = lifecycle.Switch.from_peft(model)
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=64, kv_dtype="f32")
    prompts = [[5, 17, 256, 3], [900, 1, 2, 3], [42] * 6, [7, 8]]
    temp = 0.8
    with switch.rollout() as w:
        samples = engine.generate(w, prompts, max_new_tokens=16, temperature=temp, seed=3)
        greedy = [s.tokens for s in engine.generate(w, prompts, max_new_tokens=12)]
    # the merged mode: a private bf16 copy with W + s·B·A in each adapted matrix (before PEFT's
    # merge below writes the model's own weights)
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=64, kv_dtype="f32",
                              lora_mode="merged")
    with switch.rollout() as w:
        samples_m = engine.generate(w, prompts, max_new_tokens=16, temperature=temp, seed=3)
        greedy_m = [s.tokens for s in engine.generate(w, prompts, max_new_tokens=12)]
    deltas, moved = [], []
    with torch.no_grad():
        for p, s in zip(prompts, samples):
            ids = torch.tensor([p + s.tokens], device="cuda")
            tok = torch.tensor(s.tokens, device="cuda")[:, None]
            with model.disable_adapter():
                base = model(ids).logits[0, len(p) - 1 : -1].double()
            base_lp = torch.log_softmax(base / temp, -1).gather(1, tok)[:, 0].cpu().numpy()
            moved.append(np.abs(s.logprobs - base_lp))
        merged = model.merge_and_unload().eval()
        theirs = []
        for p, s in zip(prompts, samples):
            ids = torch.tensor([p + s.tokens], device="cuda")
            tok = torch.tensor(s.tokens, device="cuda")[:, None]
            logits = merged(ids).logits[0, len(p) - 1 : -1].double()
            want = torch.log_softmax(logits / temp, -1).gather(1, tok)[:, 0].cpu().numpy()
            deltas.append(np.abs(s.logprobs - want))
            out = merged.generate(torch.tensor([p], device="cuda"), max_new_tokens=12,
                                  min_new_tokens=12, do_sample=False)
            theirs.append(out[0, len(p):].tolist())
        # PEFT's merged weights rounded to bf16, as the merged mode holds them
        for p in merged.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        deltas_m, theirs_m = [], []
        for p, s in zip(prompts, samples_m):
            ids = torch.tensor([p + s.tokens], device="cuda")
            tok = torch.tensor(s.tokens, device="cuda")[:, None]
            logits = merged(ids).logits[0, len(p) - 1 : -1].double()
            want = torch.log_softmax(logits / temp, -1).gather(1, tok)[:, 0].cpu().numpy()
            deltas_m.append(np.abs(s.logprobs - want))
            out = merged.generate(torch.tensor([p], device="cuda"), max_new_tokens=12,
                                  min_new_tokens=12, do_sample=False)
            theirs_m.append(out[0, len(p):].tolist())
    d, m = np.concatenate(deltas), np.concatenate(moved)
    dm = np.concatenate(deltas_m)
    print(f"unmerged engine vs PEFT merge_and_unload: |Δ logprob| mean {d.mean():.2e} "
          f"max {d.max():.2e}; the base alone max {m.max():.2e}; merged mode vs PEFT's merged "
          f"weights in bf16: mean {dm.mean():.2e} max {dm.max():.2e}")
    assert d.max() <= 1e-3
    assert m.max() > 1e-2
    assert greedy == theirs
    assert dm.max() <= 1e-3
    assert greedy_m == theirs_m
    switch.close()
