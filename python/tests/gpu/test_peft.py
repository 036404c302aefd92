"""``Switch.from_peft`` over a PEFT LoRA model on the GPU (a transformers Qwen2 under
``peft.get_peft_model``): the rollout holds the bf16 of the base and of the adapters under the
model's names, a refresh after an optimizer step on the adapters moves the adapters alone (and
the whole tensors trained beside them: ``modules_to_save``, ``bias="lora_only"``), a written
base weight is refused by name and cast again by the next rollout, ``named_tensors("peft")``
gives the adapters under PEFT's keys, and the engine on the unmerged adapters, and in its merged
mode, agrees with PEFT's merged model, dense and mixture-of-experts (transformers 5's fused
experts rolled out per expert). A base loaded in bf16 is read in place (the rollout buffer holds
the adapters alone), and a written or moved one is refused by name."""

import copy

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
    """The bf16 of every parameter under the switch's names (PEFT's frozen ``original_module``
    beside a ``modules_to_save`` copy left out, as the switch leaves it)."""
    named = ((peft_name(n), p) for n, p in model.named_parameters())
    return {n: p.detach().to(torch.bfloat16) for n, p in named if n is not None}


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


def test_from_peft_switches_modules_to_save_and_trainable_biases():
    """PEFT's ``modules_to_save=["lm_head"]`` and ``bias="lora_only"``: the head's trained copy
    rolls out as ``lm_head.weight`` (its frozen original is not read), the adapted modules'
    biases train beside the adapters; a refresh after an optimizer step moves them with the
    adapters (the frozen rest as enter cast it), and ``named_tensors("peft")`` holds them under
    PEFT's keys."""
    torch.manual_seed(1)
    with torch.device("cuda"):
        base = transformers.Qwen2ForCausalLM(qwen2_config()).float()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          modules_to_save=["lm_head"], bias="lora_only")
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    head = model.base_model.model.lm_head
    with torch.no_grad():  # the trained copy apart from its frozen original
        head.modules_to_save["default"].weight.add_(0.5)
    trained = ["lm_head.weight"] + [
        f"model.layers.{l}.self_attn.{m}.bias" for l in range(2) for m in ("q_proj", "v_proj")
    ]
    switch = lifecycle.Switch.from_peft(model)
    want = bf16_of(model)
    assert torch.equal(want["lm_head.weight"], head.modules_to_save["default"].weight.to(torch.bfloat16))
    with switch.rollout() as w:
        got = {n: t.clone() for n, t in w.named_tensors()}
        peft_keys = {n for n, _ in w.named_tensors("peft")}
    assert set(got) == set(want)
    assert same(got, want, want) == []
    adapters = {"base_model.model." + n for n in want if ".lora_" in n}
    biases = {f"base_model.model.model.layers.{l}.self_attn.{m}.base_layer.bias"
              for l in range(2) for m in ("q_proj", "v_proj")}
    assert peft_keys == adapters | {"base_model.model.lm_head.weight"} | biases
    # PEFT's own keys for the adapter are among them (the biases it may leave out with
    # bias="lora_only" are the live model's keys)
    assert set(peft.get_peft_model_state_dict(model)) <= peft_keys
    assert biases <= set(model.state_dict())

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    model(ids).logits.float().square().mean().backward()
    opt.step()
    after = bf16_of(model)
    moved = sorted(n for n in after if not torch.equal(after[n], want[n]))
    assert set(trained) <= set(moved), moved
    assert all(n in trained or ".lora_" in n for n in moved), moved
    with switch.rollout() as w:
        got = {n: t.clone() for n, t in w.named_tensors()}
    assert same(got, after, after) == []
    stats = switch.stats()
    assert (stats["enters"], stats["refreshes"]) == (1, 1), stats
    switch.close()


def test_from_peft_refuses_what_it_does_not_switch():
    def base():
        return transformers.Qwen2ForCausalLM(qwen2_config()).float().cuda()

    with pytest.raises(lifecycle.ConfigError, match="no LoRA adapter `default`"):
        lifecycle.Switch.from_peft(base())


def logprobs_of(model, prompts, samples, temp):
    """Each sampled token's log-probability under ``model``, teacher-forced on prompt +
    sample."""
    np = pytest.importorskip("numpy")
    out = []
    for p, s in zip(prompts, samples):
        ids = torch.tensor([p + s.tokens], device="cuda")
        tok = torch.tensor(s.tokens, device="cuda")[:, None]
        logits = model(ids).logits[0, len(p) - 1 : -1].double()
        out.append(torch.log_softmax(logits / temp, -1).gather(1, tok)[:, 0].cpu().numpy())
    return out


def greedy_of(model, prompts, n):
    """``n`` greedy tokens of ``model`` after each prompt."""
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def check_against_merged(model, name):
    """The consumer check: the engine on ``model``'s unmerged adapters (its parameters rounded to
    bf16 first, so PEFT's merged f32 model holds the rollout's numbers) against PEFT's
    ``merge_and_unload()``, teacher-forced on the engine's samples with the f32 KV cache: each
    token's log-probability within 1e-3, greedy tokens equal, the base alone far from both. The
    engine's merged mode (a private bf16 copy with ``W + s·B·A`` in each adapted matrix) alike
    against PEFT's merged weights rounded to bf16, as it holds them."""
    np = pytest.importorskip("numpy")
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
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=64, kv_dtype="f32",
                              lora_mode="merged")
    with switch.rollout() as w:
        samples_m = engine.generate(w, prompts, max_new_tokens=16, temperature=temp, seed=3)
        greedy_m = [s.tokens for s in engine.generate(w, prompts, max_new_tokens=12)]
    with torch.no_grad():
        with model.disable_adapter():
            base = logprobs_of(model, prompts, samples, temp)
        merged = model.merge_and_unload().eval()
        want = logprobs_of(merged, prompts, samples, temp)
        theirs = greedy_of(merged, prompts, 12)
        for p in merged.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        want_m = logprobs_of(merged, prompts, samples_m, temp)
        theirs_m = greedy_of(merged, prompts, 12)
    d = np.concatenate([np.abs(s.logprobs - w) for s, w in zip(samples, want)])
    m = np.concatenate([np.abs(s.logprobs - b) for s, b in zip(samples, base)])
    dm = np.concatenate([np.abs(s.logprobs - w) for s, w in zip(samples_m, want_m)])
    print(f"{name}: unmerged engine vs PEFT merge_and_unload: |Δ logprob| mean {d.mean():.2e} "
          f"max {d.max():.2e}; the base alone max {m.max():.2e}; merged mode vs PEFT's merged "
          f"weights in bf16: mean {dm.mean():.2e} max {dm.max():.2e}")
    assert d.max() <= 1e-3
    assert m.max() > 1e-2
    assert greedy == theirs
    assert dm.max() <= 1e-3
    assert greedy_m == theirs_m
    switch.close()


def test_the_engine_on_unmerged_adapters_is_pefts_merged_model():
    """A consumer no one here wrote (:func:`check_against_merged`), a dense Qwen2 with adapters
    on q, v, o and down."""
    check_against_merged(peft_model(seed=4), "Qwen2")


def qwen3_moe(seed=0):
    """A small transformers Qwen3-MoE (a dense first layer, then 4 experts, top 2), f32 on the
    GPU: in transformers 5 each MoE layer's experts are two fused parameters."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # every expert and the router drawn, the routing decisive
        for n, p in model.named_parameters():
            if ".mlp.experts." in n:
                p.normal_(0.0, 0.05)
            elif n.endswith(".mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    return model


def test_qwen3_moe_fused_experts_roll_out_per_expert_and_match_pefts_merged_model():
    """transformers 5's fused experts (``mlp.experts.gate_up_proj`` [E, 2f, h], ``down_proj``
    [E, h, f]) roll out as each expert's gate / up / down, read as views of the parameter; with
    PEFT adapters on the attention the consumer check holds for the MoE model too, and
    adapters on the experts are refused by name."""
    model = qwen3_moe()
    fused = model.model.layers[1].mlp.experts
    switch = lifecycle.Switch.from_fsdp2(model)
    with switch.rollout() as w:
        got = {n: t.clone() for n, t in w.named_tensors()}
    assert sorted(got) == sorted(n for n, _ in lifecycle.expected_parameters(model.config))
    bf = torch.bfloat16
    for e in range(4):
        at = f"model.layers.1.mlp.experts.{e}."
        assert torch.equal(got[at + "gate_proj.weight"], fused.gate_up_proj[e, :64].to(bf))
        assert torch.equal(got[at + "up_proj.weight"], fused.gate_up_proj[e, 64:].to(bf))
        assert torch.equal(got[at + "down_proj.weight"], fused.down_proj[e].to(bf))
    # a write to the fused parameter moves every expert's version: the next rollout sees it
    with torch.no_grad():
        fused.down_proj[3].add_(1.0)
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        assert torch.equal(got["model.layers.1.mlp.experts.3.down_proj.weight"],
                           fused.down_proj[3].to(bf))
    del got  # views of the rollout weights: close refuses while they are referenced
    switch.close()

    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                              "o_proj"], lora_dropout=0.0)
    adapted = peft.get_peft_model(qwen3_moe(seed=1), cfg)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    check_against_merged(adapted, "Qwen3-MoE")

    # PEFT puts a down_proj adapter on the fused experts through `target_parameters`
    on_experts = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"])
    with pytest.raises(lifecycle.ConfigError, match="target_parameters"):
        lifecycle.Switch.from_peft(peft.get_peft_model(qwen3_moe(seed=2), on_experts))


def test_from_peft_beside_an_fp8_base():
    """``from_peft(model, dtype="fp8")``: the base's matrices block-scaled e4m3, quantised once,
    the adapters bf16 beside them; a refresh after an adapter step moves the adapters alone, and
    the engine (W8A8 by default) applies them: its log-probabilities are nearer PEFT's merged
    model than the fp8 base alone's are."""
    np = pytest.importorskip("numpy")
    model = peft_model(seed=5)
    switch = lifecycle.Switch.from_peft(model, dtype="fp8")
    # attached first: attaching leaves rollout mode (the rollout after it would be an enter)
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=64, kv_dtype="f32")
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
        want = bf16_of(model)
        adapters = [n for n in want if ".lora_" in n]
        assert same(got, want, adapters) == []
    del got  # views of the rollout weights: attaching an engine refuses while they live
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(torch.randint(0, 1000, (2, 16), device="cuda")).logits.float().square().mean().backward()
    opt.step()
    prompts = [[5, 17, 256, 3], [900, 1, 2, 3], [42] * 6, [7, 8]]
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        after = bf16_of(model)
        assert same(got, after, adapters) == []
        samples = engine.generate(w, prompts, max_new_tokens=16, temperature=1.0, seed=3)
    stats = switch.stats()
    assert (stats["enters"], stats["refreshes"]) == (1, 1), stats
    with torch.no_grad():
        with model.disable_adapter():
            base = logprobs_of(model, prompts, samples, 1.0)
        merged = model.merge_and_unload().eval()
        want = logprobs_of(merged, prompts, samples, 1.0)
    d = np.concatenate([np.abs(s.logprobs - w) for s, w in zip(samples, want)])
    m = np.concatenate([np.abs(s.logprobs - b) for s, b in zip(samples, base)])
    print(f"fp8 base + bf16 adapters (W8A8) vs PEFT merged f32: |Δ logprob| mean {d.mean():.2e} "
          f"max {d.max():.2e}; vs the base alone mean {m.mean():.2e}")
    assert d.mean() < m.mean()
    del got
    switch.close()


def test_a_bf16_base_is_read_in_place():
    """A PEFT model whose base is loaded in bf16 (PEFT keeps the adapters f32): the switch lends
    and casts the adapters alone, and the engine reads the frozen base where the model keeps it,
    so the device holds the base once; the engine agrees with PEFT's merged model in f32 (the
    bf16 base's numbers, the adapters rounded to bf16 first as the rollout holds them, merged in
    f32) within 1e-3 of each sampled token's log-probability, greedy tokens equal;
    ``named_tensors()`` yields the model's own base tensors beside the adapters; a written base
    is refused by name at the next rollout, a moved one at every rollout; a bf16 base at
    ``rollout_tp=2`` or with ``dtype="fp8"`` is refused by name."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(6)
    with torch.device("cuda"):
        base = transformers.Qwen2ForCausalLM(qwen2_config()).to(torch.bfloat16)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
            if p.requires_grad:  # the adapters at bf16's numbers, as the rollout holds them
                p.copy_(p.to(torch.bfloat16).float())
    adapter_dtypes = {p.dtype for n, p in model.named_parameters() if p.requires_grad}
    frozen = {peft_name(n): p for n, p in model.named_parameters()
              if not p.requires_grad and peft_name(n) is not None}
    base_bytes = sum(p.numel() * 2 for p in frozen.values())
    for bad, match in (({"dtype": "fp8"}, "dtype bf16"), ({"rollout_tp": 2}, "rollout_tp = 1")):
        with pytest.raises(lifecycle.LifecycleError, match=match):
            lifecycle.Switch.from_peft(model, **bad)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    switch = lifecycle.Switch.from_peft(model)
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=64, kv_dtype="f32")
    prompts = [[5, 17, 256, 3], [900, 1, 2, 3], [42] * 6, [7, 8]]
    with switch.rollout() as w:
        torch.cuda.synchronize()
        rollout_bytes = torch.cuda.memory_allocated() - before
        got = dict(w.named_tensors())
        for n, p in frozen.items():
            assert got[n].data_ptr() == p.data_ptr(), n  # the model's own tensor
        buffer_bytes = sum(t.numel() * t.element_size() for n, t in got.items() if n not in frozen)
        samples = engine.generate(w, prompts, max_new_tokens=16, temperature=0.8, seed=3)
        greedy = [s.tokens for s in engine.generate(w, prompts, max_new_tokens=12)]
    del got
    adapter_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if p.requires_grad)
    print(f"bf16 base read in place: base {base_bytes / 1e6:.2f} MB, the rollout buffer "
          f"{buffer_bytes / 1e6:.3f} MB (the adapters' bf16: {adapter_bytes / 1e6:.3f} MB), the "
          f"switch and engine allocated {rollout_bytes / 1e6:.2f} MB at the first rollout "
          f"(KV cache and scratch included); adapters trained in {adapter_dtypes}")
    # the base is not copied: the rollout buffer holds the adapters alone
    assert buffer_bytes == adapter_bytes, (buffer_bytes, adapter_bytes)
    # the reference in f32: the bf16 base's numbers and the adapters merged in f32 (merging into
    # the bf16 base would round the merged weights)
    with torch.no_grad():
        merged = copy.deepcopy(model).float().merge_and_unload().eval()
        want = logprobs_of(merged, prompts, samples, 0.8)
        theirs = greedy_of(merged, prompts, 12)
    d = np.concatenate([np.abs(s.logprobs - x) for s, x in zip(samples, want)])
    print(f"bf16 base in place: engine vs PEFT merge_and_unload |Δ logprob| mean {d.mean():.2e} "
          f"max {d.max():.2e}; greedy equal: {greedy == theirs}")
    assert d.max() <= 1e-3
    assert greedy == theirs
    switch.close()


def test_a_written_or_moved_bf16_base_is_refused_by_name():
    torch.manual_seed(7)
    with torch.device("cuda"):
        base = transformers.Qwen2ForCausalLM(qwen2_config()).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    switch = lifecycle.Switch.from_peft(model)
    with switch.rollout():
        pass
    k = model.base_model.model.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        k.add_(1.0)
    with pytest.raises(lifecycle.TensorMismatchError, match=r"`model\.layers\.1\.self_attn\.k_proj\.weight`.*written"):
        with switch.rollout():
            pass
    with switch.rollout():  # the rollout after the refusal reads the base as written
        pass
    old = k.data
    k.data = k.data.clone()
    for _ in range(2):  # refused at every rollout while it is elsewhere
        with pytest.raises(lifecycle.TensorMismatchError, match=r"k_proj\.weight`.*moved"):
            with switch.rollout():
                pass
    k.data = old
    switch.close()
