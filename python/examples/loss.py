"""The loss of the Python DAPO examples: verl's GRPO advantages, its vanilla token-mean policy
loss (clip-higher, dual clip, log-ratio clamp) with its token-level truncated importance sampling
(TIS), the per-token log-probabilities a trainer recomputes, and the rollout / trainer mismatch.

Every Python example imports it (`from loss import ...`, this file beside the script); it is
checked against the torch oracle that the Rust update is checked against too
(scripts/oracles/verl_loss.py, examples/tests/fixtures/verl_loss_torch.json) by
python/tests/gpu/test_dapo_loss.py.

    adv = advantages(torch.tensor(rewards))                  # one group's rewards
    loss = verl_loss(logp, old_logp, adv[:, None], mask, rollout_logp=rollout_logp)
    delta, kl = mismatch(old_logp, rollout_logp, mask)       # what TIS corrects for
"""

from __future__ import annotations

import torch

# verl's DAPO settings (clip-higher 0.2 / 0.28, dual clip 3, log-ratio clamp, TIS cap)
CLIP_LOW = 0.2
CLIP_HIGH = 0.28
CLIP_C = 3.0
LOG_RATIO_CLAMP = 20.0
TIS_CAP = 2.0


def advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """verl's GRPO outcome advantage of one group: (r - mean) / (std + eps), std with Bessel's
    correction; a group of one sample has mean 0 and std 1 (as verl's
    `compute_grpo_outcome_advantage`)."""
    if rewards.numel() == 1:
        return rewards / (1.0 + eps)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float = TIS_CAP):
    """verl's token-level truncated importance weights min(exp(old_logp - rollout_logp), cap),
    without a gradient (neither log-probability is the trained one)."""
    return torch.clamp(torch.exp(old_logp - rollout_logp), max=cap).detach()


def verl_loss(
    logp,
    old_logp,
    adv,
    mask,
    rollout_logp=None,
    tis_cap: float | None = TIS_CAP,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    clip_c: float = CLIP_C,
):
    """verl's vanilla policy loss (`compute_policy_loss_vanilla`, loss_agg_mode "token-mean"):
    ratio = exp(clamp(logp - old_logp, -20, 20)), the clipped loss max(-A ratio, -A clip(ratio,
    1 - clip_low, 1 + clip_high)), for A < 0 the dual clip min(that, -A clip_c), then with
    `rollout_logp` (the rollout's log-probabilities of the tokens) and a cap `tis_cap` > 0 each
    token's loss times min(exp(old_logp - rollout_logp), tis_cap); the mean over `mask`.
    `tis_cap` None or <= 0 (verl applies TIS where `tis_imp_ratio_cap > 0`), or no
    `rollout_logp`, is verl's loss without TIS."""
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(l1, l2)
    l3 = -adv * clip_c
    loss = torch.where(adv < 0, torch.minimum(l3, clipped), clipped)
    if rollout_logp is not None and tis_cap is not None and tis_cap > 0:
        loss = loss * tis_weights(old_logp, rollout_logp, tis_cap)
    return (loss * mask).sum() / mask.sum()


def mismatch(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor):
    """How far the rollout's log-probabilities of the sampled tokens are from the trainer's,
    over `mask`: with r = old_logp - rollout_logp, the mean |r| and the k3 estimate
    mean(exp(r) - 1 - r) of KL(rollout || trainer) (unbiased for tokens the rollout drew, never
    negative). Two Python floats."""
    with torch.no_grad():
        r = (old_logp - rollout_logp).double()
        m = mask.double()
        n = m.sum().clamp(min=1.0)
        delta = (r.abs() * m).sum() / n
        k3 = ((torch.expm1(r) - r) * m).sum() / n
    return float(delta), float(k3)


def token_logps(model, seqs: torch.Tensor, prompt_len: int, temperature: float = 1.0):
    """log π(token) of every generated token (positions prompt_len..), under
    softmax(logits / temperature) as the rollout samples (temperature 0: greedy, scored at 1)."""
    logits = model(input_ids=seqs).logits[:, prompt_len - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)
