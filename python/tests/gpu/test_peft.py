"""``Switch.from_peft`` over a PEFT LoRA model on the GPU (a transformers Qwen2 under
``peft.get_peft_model``): the rollout holds the bf16 of the base and of the adapters under the
model's names, a refresh after an optimizer step on the adapters moves the adapters alone, a
written base weight is refused by name and cast again by the next rollout, and
``named_tensors("peft")`` gives the adapters under PEFT's keys."""

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

    # an optimizer step on the adapters: the refresh moves them alone
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    switch.train()
    model(ids).logits.float().square().mean().backward()
    opt.step()
    after = bf16_of(model)
    moved = [n for n in adapters if not torch.equal(after[n], want[n])]
    assert moved, "the step changed the adapters"
    with switch.rollout() as w:
        got = {n: t.clone() for n, t in w.named_tensors()}
    assert same(got, after, after) == []
    refresh_s = switch.last_enter[2]
    print(
        f"from_peft: enter {enter_s * 1e3:.3f} ms, adapter refresh {refresh_s * 1e3:.3f} ms "
        f"({len(moved)} of {len(adapters)} adapter matrices changed)"
    )

    # a written base weight: refused by name, then cast again
    switch.train()
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
