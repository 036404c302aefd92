"""The bridge over real FSDP2 parameters on the GPU, against torch's own tensors."""

import numpy as np
import pytest
import torch

import lifecycle
from gpu_support import fsdp2_model, qwen2_config


def full_bf16(model):
    return {n: p.full_tensor().detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def test_rollout_tensors_are_the_bf16_of_full_tensor():
    model = fsdp2_model(qwen2_config())
    switch = lifecycle.Switch.from_fsdp2(model)
    want = full_bf16(model)
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        assert set(got) == set(want)
        for n, t in got.items():
            assert t.is_cuda and t.dtype == torch.bfloat16
            assert torch.equal(t.view(torch.int16), want[n].view(torch.int16)), n
        del got


def test_an_optimizer_step_marks_the_weights_stale_and_the_next_rollout_refreshes():
    model = fsdp2_model(qwen2_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    switch = lifecycle.Switch.from_fsdp2(model)
    for _ in range(3):
        with switch.rollout():
            pass
    assert switch.stats()["generation"] == 1
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    with switch.rollout() as w:
        # an update the library never saw, inside the session: the session refuses use
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        with pytest.raises(lifecycle.StaleWeightsError, match="changed during the session"):
            list(w.named_tensors())
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        want = full_bf16(model)
        assert all(torch.equal(got[n], want[n]) for n in want)
        del got
    assert switch.stats()["generation"] == 2


def test_offload_moves_parameters_and_adamw_state_out_and_back_bit_exact():
    model = fsdp2_model(qwen2_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    switch = lifecycle.Switch.from_fsdp2(model, offload="all", optimizer=opt)
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    state = {
        (n, k): v.to_local().detach().clone()
        for n, p in model.named_parameters()
        for k, v in opt.state[p].items()
        if isinstance(v, torch.Tensor) and v.is_cuda
    }
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with switch.rollout() as w:
        torch.cuda.synchronize()
        during = torch.cuda.memory_allocated()
        got = dict(w.named_tensors())
        for n, p in model.named_parameters():
            assert torch.equal(got[n], params[n].to(torch.bfloat16)), n
        del got
    moved = sum(t.numel() * 4 for t in params.values()) + sum(t.numel() * 4 for t in state.values())
    assert before - during >= moved * 0.99, (before, during, moved)
    # leaving rollout mode brings everything back, bit for bit
    switch.train()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() >= before
    for n, p in model.named_parameters():
        assert torch.equal(p.to_local(), params[n]), n
        for k, v in opt.state[p].items():
            if (n, k) in state:
                assert torch.equal(v.to_local(), state[(n, k)]), (n, k)
    # in rollout mode again, a forward alone brings the state back first (the switch's
    # forward pre-hook, before FSDP2's all-gather), and training goes on
    with switch.rollout():
        pass
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    # (read before entering: during rollout the parameters' storages are released, and any
    # torch access to them is invalid)
    want = full_bf16(model)
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        assert all(torch.equal(got[n], want[n]) for n in want)
        del got


def test_exit_is_refused_while_a_rollout_tensor_is_referenced():
    model = fsdp2_model(qwen2_config())
    switch = lifecycle.Switch.from_fsdp2(model)
    with switch.rollout() as w:
        kept = dict(w.named_tensors())["lm_head.weight"]
    with pytest.raises(lifecycle.TensorsInUseError, match="lm_head.weight"):
        switch.train()
    del kept
    switch.train()


def test_hugging_face_generates_what_the_engine_generates():
    config = qwen2_config()
    model = fsdp2_model(config, seed=3)
    switch = lifecycle.Switch.from_fsdp2(model)
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=48)
    prompts = [[5, 17, 256, 3], [900, 1, 2, 3], [42] * 6, [7, 8]]
    new = 16
    import transformers

    hf = transformers.Qwen2ForCausalLM(config).cuda().float().eval()
    with switch.rollout() as w:
        samples = engine.generate(w, prompts, max_new_tokens=new)
        hf.load_state_dict({n: t.float() for n, t in w.named_tensors("hf")})
    ours = [s.tokens for s in samples]
    assert all(s.finish_reason == "length" for s in samples)
    theirs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
            theirs.append(out[0, len(p):].tolist())
    assert ours == theirs


def test_a_small_paged_cache_serves_what_a_large_one_does():
    """A KV cache of 3 pages (192 positions) for 8 slots: a pair of samples of a 70-token prompt
    holds 2 pages + 1 (their full first page shared), so the pairs run one after the other;
    their greedy tokens are those of a cache with room for all 8 at once (steps of at most 8
    rows: each row's sums its own). A prompt longer than a sequence holds is refused."""
    config = qwen2_config()
    model = fsdp2_model(config, seed=3)
    switch = lifecycle.Switch.from_fsdp2(model)
    prompts = [[(7 * g + i) % 500 + 1 for i in range(70)] for g in range(4) for _ in range(2)]
    runs = []
    for kv_tokens in (None, 192):
        engine = lifecycle.Engine(switch, max_sequences=8, max_tokens=192, kv_tokens=kv_tokens)
        with switch.rollout() as w:
            runs.append([s.tokens for s in engine.generate(w, prompts, max_new_tokens=40)])
            if kv_tokens is not None:
                with pytest.raises(lifecycle.ConfigError, match="needs 199 KV positions; a slot holds 192"):
                    engine.generate(w, prompts[:1], max_new_tokens=130)
    assert all(len(t) == 40 for t in runs[1])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
def test_log_probs_are_transformers_log_softmax_at_the_temperature(kv_dtype):
    """Sampled with top-p / top-k and stop tokens, then teacher-forced through transformers:
    each token's log-probability is log_softmax(logits / T) of transformers' logits (f32 cache:
    within 1e-3; bf16: mean and max printed), the raw one at T = 1."""
    config = qwen2_config()
    model = fsdp2_model(config, seed=5)
    switch = lifecycle.Switch.from_fsdp2(model)
    engine = lifecycle.Engine(switch, max_sequences=3, max_tokens=64, kv_dtype=kv_dtype)
    prompts = [[5, 17, 256, 3], [900, 1, 2, 3], [42] * 6, [7, 8], [7, 8]]
    import transformers

    hf = transformers.Qwen2ForCausalLM(config).cuda().float().eval()
    temp = 0.8
    with switch.rollout() as w:
        samples = engine.generate(
            w, prompts, max_new_tokens=[20, 12, 30, 20, 5], temperature=temp, top_p=0.9, top_k=50,
            stop_tokens=list(range(0, config.vocab_size, 97)), seed=11,
        )
        hf.load_state_dict({n: t.float() for n, t in w.named_tensors("hf")})
    deltas, raw_deltas = [], []
    with torch.no_grad():
        for p, s in zip(prompts, samples):
            assert s.finish_reason in ("stop", "length")
            assert len(s.logprobs) == len(s.tokens) == len(s.raw_logprobs)
            ids = torch.tensor([p + s.tokens], device="cuda")
            logits = hf(ids).logits[0, len(p) - 1 : -1].double()
            tok = torch.tensor(s.tokens, device="cuda")[:, None]
            want = torch.log_softmax(logits / temp, -1).gather(1, tok)[:, 0].cpu().numpy()
            raw = torch.log_softmax(logits, -1).gather(1, tok)[:, 0].cpu().numpy()
            deltas.append(np.abs(s.logprobs - want))
            raw_deltas.append(np.abs(s.raw_logprobs - raw))
            assert np.all(s.truncated_logprobs >= s.logprobs - 1e-6)
    d, r = np.concatenate(deltas), np.concatenate(raw_deltas)
    print(f"kv {kv_dtype}: |Δ logprob| mean {d.mean():.2e} max {d.max():.2e}; raw max {r.max():.2e}")
    if kv_dtype == "f32":
        assert d.max() <= 1e-3 and r.max() <= 1e-3


def fp8_switches(config, seed):
    """An fp8 switch over an FSDP2 model's shards, and the host switch of its full tensors."""
    model = fsdp2_model(config, seed=seed)
    gpu = lifecycle.Switch.from_fsdp2(model, dtype="fp8")
    host = lifecycle.Switch.from_arrays(
        config,
        [(n, p.full_tensor().detach().cpu().numpy().copy()) for n, p in model.named_parameters()],
        dtype="fp8",
    )
    return gpu, host


def test_fp8_tensors_equal_the_reference_executors():
    gpu, host = fp8_switches(qwen2_config(hidden_size=256, intermediate_size=512), seed=5)
    with gpu.rollout() as w:
        g = {h.name: torch.from_dlpack(h.bits()).cpu().numpy().copy() for h in w.handles()}
    with host.rollout() as w:
        c = {h.name: np.from_dlpack(h.bits()).copy() for h in w.handles()}
    assert set(g) == set(c) and any(n.endswith("weight_scale_inv") for n in g)
    for n in c:
        np.testing.assert_array_equal(g[n], c[n], err_msg=n)


def test_vllm_format_has_vllms_names_and_shapes():
    config = qwen2_config()
    model = fsdp2_model(config)
    switch = lifecycle.Switch.from_fsdp2(model)
    want = lifecycle.vllm_names(config, 1)
    with switch.rollout() as w:
        got = [(n, list(t.shape)) for n, t in w.named_tensors("vllm")]
        hf = dict(w.named_tensors("hf"))
        v = dict(w.named_tensors("vllm"))
        qkv = v["model.layers.0.self_attn.qkv_proj.weight"]
        parts = [hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]
        assert torch.equal(qkv, torch.cat(parts))
        emb = v["model.embed_tokens.weight"]
        assert emb.shape[0] == 1024 and torch.equal(emb[:1000], hf["model.embed_tokens.weight"])
        assert not emb[1000:].any()
        del hf, v, qkv, parts, emb
    assert [tuple(x) for x in got] == [(n, s) for n, s in want]


def host_bits(t):
    """A rollout tensor as the host switch's arrays hold it: bf16 as uint16, e4m3 as uint8."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).cpu().numpy()
    return t.cpu().numpy()


def test_fp8_vllm_format_on_the_gpu_is_the_host_executors():
    # head_dim 128 (2 heads of 256), 1 kv head: every part of qkv_proj fills whole blocks
    config = qwen2_config(num_attention_heads=2, num_key_value_heads=1)
    gpu, host = fp8_switches(config, seed=6)
    with gpu.rollout() as w:
        g = [(n, t) for n, t in w.named_tensors("vllm")]
        fp8 = {n for n, t in g if t.dtype == torch.float8_e4m3fn}
        g = [(n, host_bits(t)) for n, t in g]
    with host.rollout() as w:
        c = [(n, np.array(a)) for n, a in w.named_arrays("vllm")]
    assert [n for n, _ in g] == [n for n, _ in c]
    assert [n for n, _ in g] == [n for n, _ in lifecycle.vllm_names(config, 1, dtype="fp8")]
    assert "model.layers.0.self_attn.qkv_proj.weight" in fp8
    for (n, a), (_, b) in zip(g, c):
        np.testing.assert_array_equal(a, b, err_msg=n)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_non_finite_master_after_a_step_is_refused_at_the_switch(dtype):
    # the switch's casts (bf16) and quantisations (fp8) read every master once: a NaN there is
    # refused by name, nothing rolls out, the training state and the generation stay
    model = fsdp2_model(qwen2_config(), seed=8)
    switch = lifecycle.Switch.from_fsdp2(model, dtype=dtype)
    with switch.rollout() as w:
        before = {n: host_bits(t).copy() for n, t in w.named_tensors()}
    name = "model.layers.1.mlp.down_proj.weight"
    param = dict(model.named_parameters())[name]
    with torch.no_grad():
        param.to_local()[3, 7] = float("nan")  # as a diverged optimizer step leaves it
    masters = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    generation = switch.stats()["generation"]
    for _ in range(2):
        with pytest.raises(lifecycle.NonFiniteError, match=rf"`{name}` holds a non-finite value"):
            with switch.rollout(refresh=True):
                pass
    assert switch.stats()["generation"] == generation and switch.held() == []
    for n, p in model.named_parameters():
        assert torch.equal(p.to_local(), masters[n]) or n == name, n
    with torch.no_grad():
        param.to_local()[3, 7] = 0.0
    with switch.rollout() as w:
        after = {n: host_bits(t).copy() for n, t in w.named_tensors()}
    assert switch.stats()["generation"] == generation + 1
    assert all((after[n] == before[n]).all() for n in before if "layers.1.mlp.down_proj" not in n)


def test_bad_requests_are_refused_by_name():
    """P13 (ranges): each refused naming the request and its field, before anything runs; the
    engine serves the next call."""
    config = qwen2_config()
    model = fsdp2_model(config, seed=3)
    switch = lifecycle.Switch.from_fsdp2(model)
    engine = lifecycle.Engine(switch, max_sequences=2, max_tokens=16)
    prompts = [[1, 2, 3], [4, 5]]
    with switch.rollout() as w:
        for kwargs, message in [
            (dict(top_p=0.0), "request 0: `top_p` must lie in (0, 1]"),
            (dict(top_p=1.5), "`top_p`"),
            (dict(top_k=0), "`top_k` must be at least 1"),
            (dict(temperature=-1.0), "`temperature` must be finite and >= 0"),
            (dict(stop_tokens=[config.vocab_size]), "`stop_tokens` token"),
            (dict(max_new_tokens=[4, 16]), "request 1: `max_new_tokens` with a prompt of 2 tokens needs 17"),
        ]:
            args = dict(max_new_tokens=4)
            args.update(kwargs)
            with pytest.raises(lifecycle.ConfigError) as e:
                engine.generate(w, prompts, **args)
            assert message in str(e.value), (kwargs, str(e.value))
        ok = engine.generate(w, prompts, max_new_tokens=4)
    assert [len(s.tokens) for s in ok] == [4, 4]


@pytest.mark.parametrize("leftovers", ["abort", "partial"])
def test_group_stream_keeps_the_wanted_groups_across_an_update(leftovers):
    """DAPO's dynamic sampling streamed: two fills with an optimizer step between them; each
    keeps the wanted groups; in partial mode requests carried over the update record both
    weight versions, in abort mode nothing is carried."""
    config = qwen2_config()
    model = fsdp2_model(config, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    switch = lifecycle.Switch.from_fsdp2(model, optimizer=opt)
    engine = lifecycle.Engine(switch, max_sequences=6, max_tokens=64)
    stream = lifecycle.GroupStream(
        engine, 3, max_new_tokens=40, temperature=1.0, seed=5, leftovers=leftovers,
        stop_tokens=list(range(0, config.vocab_size, 11)),
    )
    prompt = lambda g: [(g * 7 + i) % config.vocab_size for i in range(5)]
    keep = lambda g, samples: g % 2 == 0
    fills = []
    for step in range(2):
        with switch.rollout() as w:
            f = stream.fill(w, 2, group=prompt, keep=keep)
        fills.append(f)
        assert len(f.kept) == 2 and all(len(s) == 3 for _, s in f.kept)
        assert all(g % 2 == 0 for g, _ in f.kept)
        for _, samples in f.kept:
            for s in samples:
                assert s.finish_reason in ("stop", "length")
                assert len(s.versions) == len(s.tokens) == len(s.logprobs)
        # the update: the optimizer writes the shards, the next rollout is on new weights
        sum(p.float().sum() for p in model.parameters()).backward()
        opt.step()
        opt.zero_grad()
    print(leftovers, [(f.carried, f.aborted, f.stale, f.kept_mean_len, f.finished_mean_len) for f in fills])
    if leftovers == "abort":
        assert all(f.carried == 0 for f in fills)
    else:
        assert all(f.aborted == 0 for f in fills) and fills[0].carried > 0
        for _, ss in fills[1].kept:
            for s in ss:
                # a sample carried over the update: its first tokens on the old weights
                assert s.versions == sorted(s.versions) and len(set(s.versions)) <= 2
