"""The bridge over a real Megatron-Core model on the GPU (TP = PP = DP = 1; several ranks:
``megatron_ranks.py``): a ``GPTModel`` built with the local spec (dense, or Qwen3-MoE shaped),
in ``Float16Module`` and ``DistributedDataParallel`` with the distributed optimizer, as
Megatron's ``get_model`` and ``get_megatron_optimizer`` make them (``megatron_support.py``).
Skipped where ``megatron-core`` is not installed (the device installs its wheel)."""

import pytest
import torch

core = pytest.importorskip("megatron.core")

import lifecycle  # noqa: E402

from megatron_support import (  # noqa: E402
    FFN,
    VOCAB,
    expected,
    hf_checkpoint,
    hf_config,
    megatron_model,
)

KINDS = {"qwen2": (False, False), "qwen3": (True, False), "qwen3-moe": (True, True)}


def own(gpt, qk_norm: bool, moe: bool = False) -> dict:
    """The fused rollout tensors expected from ``gpt``'s own parameters."""
    from lifecycle._megatron import layout_name

    p = {layout_name(n): t.detach() for n, t in gpt.named_parameters()}
    return expected(p, qk_norm, moe)


def same(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for n, t in got.items():
        assert t.dtype == torch.bfloat16 and t.is_cuda, n
        assert torch.equal(t.view(torch.int16), want[n].view(torch.int16)), n


def step(model, gpt, opt):
    """One forward, backward and optimizer step of Megatron's own."""
    ids = torch.randint(0, VOCAB, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda").unsqueeze(0).expand(2, -1)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    model.finish_grad_sync()
    opt.step()
    opt.zero_grad()
    model.zero_grad_buffer()


@pytest.mark.parametrize("kind", list(KINDS))
def test_from_megatron_reads_the_parameters_in_place_into_the_fused_layout(kind):
    qk_norm, moe = KINDS[kind]
    model, gpt, opt = megatron_model(qk_norm, moe)
    # the parameters live in DDP's bf16 buffer, in reverse order: the switch reads them there
    buf = model.buffers[0].param_data
    inside = [
        buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() * 2
        for p in gpt.parameters()
    ]
    assert all(inside), "every parameter a view into param_data"
    switch = lifecycle.Switch.from_megatron(model, opt, hf_config(qk_norm, moe))
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        same(got, own(gpt, qk_norm, moe))
        del got
    print(f"from_megatron {kind}: {len(switch._sources)} parameters read in place, the fused "
          "rollout bit-identical to Megatron's regrouped parameters")


def test_an_optimizer_step_the_switch_never_saw_marks_the_weights_stale():
    model, gpt, opt = megatron_model()
    switch = lifecycle.Switch.from_megatron(model, opt, hf_config(False))
    for _ in range(3):
        with switch.rollout():
            pass
    assert switch.stats()["generation"] == 1
    before = [p._version for p in gpt.parameters()]
    switch.train()
    step(model, gpt, opt)
    # the distributed optimizer writes through .data: no parameter's counter moved, so a
    # switch that read them alone would reuse the old weights
    assert [p._version for p in gpt.parameters()] == before
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        same(got, own(gpt, False))
        del got
    assert switch.stats()["generation"] == 2
    print("an unseen Megatron optimizer step: the next rollout refreshed (generation 2), "
          "the parameters' own counters unmoved")


def test_offload_moves_the_training_state_out_and_back_bit_for_bit():
    """offload="all": while a rollout runs, DDP's parameter and gradient buffers, the fp32 main
    parameters and the Adam moments are released (torch's allocated memory drops by their
    bytes); the rollout is bit-identical to Megatron's parameters regrouped; back in train mode
    every tensor holds its bytes again (the parameters still views of param_data), and a
    further step and rollout run on them."""
    from lifecycle._megatron import offload_buffers

    from lifecycle._megatron import torch_optimizers

    model, gpt, opt = megatron_model()
    step(model, gpt, opt)  # the Adam moments exist
    inner = torch_optimizers(opt)
    main = [p for o in inner for g in o.param_groups for p in g["params"]]
    state = [
        t
        for o in inner
        for p in main
        for t in o.state.get(p, {}).values()
        if isinstance(t, torch.Tensor) and t.is_cuda
    ]
    assert state, "Adam's moments on the GPU"
    tracked = {
        "param_data": model.buffers[0].param_data,
        "grad_data": model.buffers[0].grad_data,
        **{f"main {i}": p.data for i, p in enumerate(main)},
        **{f"adam {i}": t for i, t in enumerate(state)},
    }
    kept = {n: t.detach().clone().cpu() for n, t in tracked.items()}
    want = {n: t.clone() for n, t in own(gpt, False).items()}
    moved = sum(b[3] for b in offload_buffers(model, opt, "all")()[0])
    switch = lifecycle.Switch.from_megatron(model, opt, hf_config(False), offload="all")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    with switch.rollout() as w:
        torch.cuda.synchronize()
        freed = held - torch.cuda.memory_allocated()
        got = dict(w.named_tensors())
        same(got, want)
        del got
    assert moved >= 0.99 * freed and freed >= 0.99 * moved, (freed, moved)
    switch.train()
    for n, t in tracked.items():
        bytes_now = t.detach().cpu().reshape(-1).view(torch.uint8)
        assert torch.equal(bytes_now, kept[n].reshape(-1).view(torch.uint8)), n
    buf = model.buffers[0].param_data
    assert all(
        buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() * 2 for p in gpt.parameters()
    ), "every parameter still a view into param_data"
    step(model, gpt, opt)
    want = {n: t.clone() for n, t in own(gpt, False).items()}
    with switch.rollout() as w:
        got = dict(w.named_tensors())
        same(got, want)
        del got
    switch.train()
    print(f"offload all: {moved / 2**20:.1f} MiB released during the rollout ({freed / 2**20:.1f} "
          "MiB by torch's count), every byte restored; a step and a rollout after it agree")


def test_megatron_models_the_switch_cannot_read_are_refused_by_name():
    model, gpt, opt = megatron_model(overlap_param_gather=True)
    with pytest.raises(lifecycle.ConfigError, match="overlap_param_gather"):
        lifecycle.Switch.from_megatron(model, opt, hf_config(False))
    model, gpt, opt = megatron_model()
    wrong = {**hf_config(False), "intermediate_size": FFN * 2}
    with pytest.raises(lifecycle.TensorMismatchError, match="linear_fc1"):
        lifecycle.Switch.from_megatron(model, opt, wrong)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3-moe"])
def test_our_engine_agrees_with_megatrons_forward_and_transformers(kind, tmp_path):
    """Teacher-forced consumer checks on the switched weights of a trained step: our engine's
    greedy tokens and their log-probabilities against (1) Megatron-Core's own forward over the
    same tokens and (2) transformers' model loaded from the rollout tensors saved as a Hugging
    Face checkpoint (q / k / v, gate / up and each expert apart). Greedy tokens must equal each
    consumer's argmax except where its top two logits are closer than EPS; the log-probability
    of every token within MEAN (mean) and TOL (max) of the consumer's ``log_softmax`` (bf16 weights and activations
    on both sides, our KV cache bf16; looser for a mixture of experts, below)."""
    import json

    import transformers
    from safetensors.torch import save_file

    EPS = 0.05
    qk_norm, moe = KINDS[kind]
    # |d logp| bounds, mean and max: bf16 on both sides; a mixture-of-experts token whose top
    # experts' router scores nearly tie may be routed apart (bf16 router logits), which moves
    # its log-probability by up to a few tenths
    MEAN, TOL = (0.03, 0.3) if moe else (0.01, 0.1)
    model, gpt, opt = megatron_model(qk_norm, moe)
    step(model, gpt, opt)
    cfg = hf_config(qk_norm, moe)
    switch = lifecycle.Switch.from_megatron(model, opt, cfg)
    engine = lifecycle.Engine(switch, max_sequences=4, max_tokens=96)
    draw = torch.Generator().manual_seed(7)
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (16,), generator=draw)] for _ in range(4)]
    with switch.rollout() as w:
        samples = engine.generate(w, prompts, max_new_tokens=24)
        save_file(hf_checkpoint(dict(w.named_tensors()), moe), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    switch.train()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    hf = hf.cuda().eval()

    def megatron_logits(seq):
        pos = torch.arange(seq.shape[1], device="cuda").unsqueeze(0)
        return model(seq, pos, None).float()[0, :, :VOCAB]

    def transformers_logits(seq):
        return hf(seq).logits.float()[0]

    for name, forward in (("Megatron-Core", megatron_logits), ("transformers", transformers_logits)):
        checked = close = 0
        deltas = []
        with torch.no_grad():
            for p, s in zip(prompts, samples):
                seq = torch.tensor([p + s.tokens], device="cuda")
                logits = forward(seq)
                for j, tok in enumerate(s.tokens):
                    row = logits[len(p) - 1 + j]
                    deltas.append(abs(float(torch.log_softmax(row, -1)[tok]) - float(s.logprobs[j])))
                    top = torch.topk(row, 2)
                    if float(top.values[0] - top.values[1]) < EPS:
                        close += 1
                        continue
                    assert int(top.indices[0]) == tok, (name, j, int(top.indices[0]), tok)
                    checked += 1
        mean, worst = sum(deltas) / len(deltas), max(deltas)
        print(f"{kind}: engine vs {name}: {checked} greedy tokens equal, {close} near-ties "
              f"(top two within {EPS}) skipped; |d logp| mean {mean:.2e}, max {worst:.2e}")
        assert checked > 0
        assert mean <= MEAN and worst <= TOL, (name, mean, worst)
