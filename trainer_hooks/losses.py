"""RL losses for the trainer side: GRPO advantages, token log-probs, a PPO-clip policy loss with
truncated importance sampling (TIS), a per-token staleness bound and a k3 KL penalty.

Three log-prob tensors meet in the loss (decoupled PPO, as in AReaL):

- `new_logp`   log pi_theta(a_t): the policy being optimised (carries the gradient);
- `old_logp`   log pi_prox(a_t): the *proximal* policy, recomputed by the trainer with the weights
               the batch is trained from (detached). PPO clips `ratio = exp(new - old)` around it;
- `behaviour_logp` log mu(a_t): what the engine reported when it sampled the token. It differs
               from `old_logp` because of staleness (the token was sampled by an older version)
               and engine/trainer numeric mismatch (kernels, dtype).

Per token t with advantage A_t (all tensors [B, T], `mask` selects the tokens to train: the
completion, or a multi-turn episode's model turns only, `collate`'s `completion_mask`, so
observation tokens from an environment never enter the loss):

    ratio_t = exp(new_t - old_t)
    pg_t    = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    w_t     = min(exp(old_t - behaviour_t), tis_cap)             (detached; 1 when TIS is off)
    k3_t    = exp(ref_t - new_t) - (ref_t - new_t) - 1            (>= 0, unbiased KL(pi||ref))
    loss_t  = w_t * pg_t + kl_coef * k3_t

`mismatch/logp_abs_diff_*` compare old_logp with behaviour_logp on every trained token
(staleness and numerics together); `mismatch/logprob_abs_diff_max` only on the tokens of
policy staleness 0, sampled with the very weights the trainer holds: the numeric mismatch
alone, exactly 0.0 in batch-invariant mode (`trainer_hooks.batch_invariant`).

`w` reweights tokens sampled by mu as if they came from pi_prox, truncated at `tis_cap` so a
few wildly off-policy tokens cannot blow up the variance. Tokens whose policy staleness exceeds
`max_staleness` are masked out before aggregation (token-level staleness bound).

Aggregation: "token-mean" = sum(loss_t * m_t) / sum(m_t) over the batch (every token counts the
same); "seq-mean" = mean over sequences of each sequence's token mean (every sample counts the
same, as in the original GRPO). The config spellings token_mean / seq_mean are accepted too.

Metric keys returned are already namespaced (`train/*`, `mismatch/*`, `staleness/*`) so they can
go straight to `rollout.metrics.MetricsLogger.log`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from rollout.models import batch_invariant

LossAgg = Literal["token-mean", "seq-mean"]
_LOSS_AGGS = ("token-mean", "seq-mean")


def group_advantages(
    rewards: Tensor, n: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by (std + eps).

    `rewards` is flat [G * n] with the n samples of a prompt contiguous. A group whose rewards are
    all equal gets advantage 0 (no signal, no NaN). std is the unbiased sample std (n - 1).
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [G*n], got shape {tuple(rewards.shape)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")
    if rewards.numel() % n:
        raise ValueError(f"len(rewards)={rewards.numel()} is not a multiple of n={n}")
    groups = rewards.view(-1, n)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and n > 1:
        adv = adv / (groups.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def token_log_probs(
    logits: Tensor, targets: Tensor, chunk_tokens: int = 1024, temperature: float = 1.0
) -> Tensor:
    """log softmax(logits / temperature)[targets] in fp32: logits [B, T, V], targets [B, T] ->
    [B, T].

    No shift: position t's logits score `targets[:, t]`. fp32 because bf16 log-softmax is too
    coarse to compare trainer and engine log-probs. Computed over chunks of `chunk_tokens`
    positions, so the fp32 copy of a large-vocabulary batch never exists at once, by the engine
    sampler's own formula (`rollout.models.batch_invariant.log_softmax`): under
    `trainer_hooks.batch_invariant.enabled()` the result equals the behaviour log-probs bitwise.
    `temperature` must be the one the behaviour log-probs were computed at, so the two are the
    same function of the same weights: `SamplingParams.logprobs_temperature` (1 for raw,
    the sampling temperature for processed; `rollout.sampling.logprobs_temperature`).
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and targets [B, T]; got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    _check_temperature(temperature)
    flat = logits.reshape(-1, logits.shape[-1])
    tgt = targets.reshape(-1, 1).long()
    parts = []
    for i in range(0, flat.shape[0], max(1, chunk_tokens)):
        # the engine sampler's formula (rollout.models.batch_invariant): the same bits per row
        chunk = batch_invariant.log_softmax(flat[i : i + chunk_tokens], temperature)
        parts.append(chunk.gather(-1, tgt[i : i + chunk_tokens]).squeeze(-1))
    if not parts:
        return torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).view(targets.shape)


def sequence_log_probs(
    logits: Tensor, tokens: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> Tensor:
    """Per-token log-probs aligned with `tokens`: out[:, t] = log p(tokens[:, t] | tokens[:, :t]),
    p = softmax(logits / temperature) (`token_log_probs`: pass the behaviour's temperature).

    `logits` are the model's outputs on `tokens` ([B, T, V], logits[:, t] predicts t + 1).
    Position 0 has no prediction and is 0; positions where `mask` is False are 0. The result
    lines up with a completion mask and with the engine's behaviour log-probs placed at the same
    positions, so `policy_loss` can take all of them as [B, T].
    """
    if tokens.dim() != 2 or logits.shape[:2] != tokens.shape:
        raise ValueError(
            f"expected logits [B, T, V] over tokens [B, T]; got {tuple(logits.shape)} and "
            f"{tuple(tokens.shape)}"
        )
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    out[:, 1:] = token_log_probs(logits[:, :-1], tokens[:, 1:], temperature=temperature)
    if mask is not None:
        out = out * _check_mask(mask, tokens.shape)
    return out


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, bool) or not (
        isinstance(temperature, (int, float)) and temperature > 0
    ):
        raise ValueError(
            f"temperature must be a number > 0 (the behaviour log-probs' logprobs_temperature), "
            f"got {temperature!r}"
        )


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || ref) from samples of pi: e^(r-l) - (r-l) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over mask (0 where the mask is empty instead of NaN)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def policy_loss(
    new_logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    behaviour_logp: Tensor | None = None,
    tis_cap: float | None = None,
    kl_coef: float = 0.0,
    ref_logp: Tensor | None = None,
    loss_agg: LossAgg = "token-mean",
    staleness: Tensor | None = None,
    max_staleness: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip / GRPO policy loss with optional TIS, staleness mask and k3 KL (module docstring).

    Shapes: log-probs, `mask` and `staleness` are [B, T]; `advantages` is [B] (one per sample,
    GRPO) or [B, T]. `old_logp=None` means one gradient step per batch (old = new, detached).
    `tis_cap` needs `behaviour_logp`; `kl_coef > 0` needs `ref_logp`; `max_staleness` needs
    `staleness`. Returns (scalar loss, metrics of python floats).
    """
    shape = new_logp.shape
    if new_logp.dim() != 2:
        raise ValueError(f"new_logp must be [B, T], got shape {tuple(shape)}")
    m = _check_mask(mask, shape).to(new_logp.device)
    adv = _broadcast_advantages(advantages, shape).to(new_logp.device)
    old = new_logp.detach() if old_logp is None else _same_shape("old_logp", old_logp, shape)
    old = old.detach().float()
    loss_agg = _check_args(
        clip_eps_low, clip_eps_high, loss_agg, tis_cap, behaviour_logp, kl_coef, ref_logp
    )

    metrics: dict[str, float] = {}
    if max_staleness is not None:
        if staleness is None:
            raise ValueError("max_staleness is set but staleness is None")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        stale = _same_shape("staleness", staleness, shape).to(m.device) > max_staleness
        metrics["staleness/masked_token_frac"] = _frac(stale & m, m)
        m = m & ~stale

    # Masked positions (prompt, padding, stale) are zeroed before exp: garbage there must not
    # overflow to inf and turn the masked sum (or its gradient) into NaN.
    new = new_logp.float()
    log_ratio = torch.where(m, new - old, 0.0)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    weight = torch.ones_like(new)
    if behaviour_logp is not None:
        beh = _same_shape("behaviour_logp", behaviour_logp, shape).detach().float()
        raw = torch.exp(torch.where(m, old - beh, 0.0))
        if tis_cap is not None:
            weight = raw.clamp(max=tis_cap)
        metrics.update(_mismatch_metrics(old, beh, raw, m, tis_cap))
        fresh = m
        if staleness is not None:
            fresh = m & (_same_shape("staleness", staleness, shape).to(m.device) == 0)
        # numeric mismatch alone: tokens the trainer's current weights sampled (exactly 0.0
        # with trainer_hooks.batch_invariant on both sides)
        metrics["mismatch/logprob_abs_diff_max"] = _masked_max((old - beh).abs(), fresh)
    per_token = weight * pg

    kl = None
    if ref_logp is not None:
        ref = _same_shape("ref_logp", ref_logp, shape).detach().float()
        kl = k3_kl(torch.where(m, new, 0.0), torch.where(m, ref, 0.0))
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl

    loss = _aggregate(per_token, m, loss_agg)
    with torch.no_grad():
        mf = m.float()
        metrics["train/pg_loss"] = _aggregate(weight * pg, m, loss_agg).item()
        metrics["train/clip_fraction"] = _frac((pg_clipped > pg_unclipped) & m, m)
        # k3 of KL(pi_old || pi_theta)
        metrics["train/approx_kl"] = masked_mean(ratio - log_ratio - 1.0, mf).item()
        metrics["train/ratio_max"] = _masked_max(ratio, m)
        metrics["train/is_weight_mean"] = masked_mean(weight, mf).item()
        metrics["train/is_weight_max"] = _masked_max(weight, m)
        metrics["train/tokens"] = float(m.sum().item())
        if kl is not None:
            metrics["train/kl"] = masked_mean(kl, mf).item()
        metrics["train/loss"] = loss.item()
    return loss, metrics


def _mismatch_metrics(
    old: Tensor, beh: Tensor, raw: Tensor, m: Tensor, tis_cap: float | None
) -> dict[str, float]:
    """Trainer-vs-engine drift on the same tokens (staleness + numeric mismatch together)."""
    with torch.no_grad():
        mf = m.float()
        d = torch.where(m, old - beh, 0.0)
        diff = d.abs()
        out = {
            "mismatch/logp_abs_diff_mean": masked_mean(diff, mf).item(),
            "mismatch/logp_abs_diff_max": _masked_max(diff, m),
            "mismatch/kl_k3": masked_mean(raw - d - 1.0, mf).item(),  # k3 of KL(mu || pi_old)
            "mismatch/is_weight_raw_max": _masked_max(raw, m),
        }
        if tis_cap is not None:
            out["mismatch/tis_truncated_frac"] = _frac((raw > tis_cap) & m, m)
        return out


def _aggregate(per_token: Tensor, m: Tensor, loss_agg: str) -> Tensor:
    mf = m.to(per_token.dtype)
    if loss_agg == "token-mean":
        return (per_token * mf).sum() / mf.sum().clamp_min(1.0)
    counts = mf.sum(dim=1)
    seq = (per_token * mf).sum(dim=1) / counts.clamp_min(1.0)
    nonempty = (counts > 0).to(per_token.dtype)
    return (seq * nonempty).sum() / nonempty.sum().clamp_min(1.0)


def _check_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != expected {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    if not torch.all((mask == 0) | (mask == 1)):
        raise ValueError("mask must be boolean or hold only 0/1")
    return mask.bool()


def _same_shape(name: str, x: Tensor, shape: torch.Size) -> Tensor:
    if x.shape != shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} != new_logp shape {tuple(shape)}")
    return x


def _broadcast_advantages(adv: Tensor, shape: torch.Size) -> Tensor:
    adv = torch.as_tensor(adv).float()
    if adv.dim() == 1 and adv.shape[0] == shape[0]:
        return adv.unsqueeze(1).expand(shape)
    if adv.shape == shape:
        return adv
    raise ValueError(
        f"advantages must be [B] or [B, T] for B, T = {tuple(shape)}, got {tuple(adv.shape)}"
    )


def _check_args(
    low: float,
    high: float,
    loss_agg: Any,
    tis_cap: float | None,
    behaviour_logp: Tensor | None,
    kl_coef: float,
    ref_logp: Tensor | None,
) -> str:
    """Validate the scalar knobs; returns loss_agg normalised ("token_mean" -> "token-mean")."""
    if not 0.0 <= low < 1.0:
        raise ValueError(f"clip_eps_low must be in [0, 1), got {low}")
    if not high >= 0.0:
        raise ValueError(f"clip_eps_high must be >= 0, got {high}")
    agg = str(getattr(loss_agg, "value", loss_agg)).replace("_", "-")  # config enum spelling
    if agg not in _LOSS_AGGS:
        raise ValueError(f"loss_agg={loss_agg!r} is not one of {_LOSS_AGGS}")
    if tis_cap is not None:
        if behaviour_logp is None:
            raise ValueError(
                "tis_cap is set but behaviour_logp is None (TIS needs the engine's log-probs)"
            )
        if not tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0 (or None to disable TIS), got {tis_cap}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp (the reference policy's log-probs)")
    return agg


def _frac(hit: Tensor, m: Tensor) -> float:
    return (hit.sum().float() / m.sum().clamp_min(1).float()).item()


def _masked_max(x: Tensor, m: Tensor) -> float:
    return x[m].max().item() if bool(m.any()) else 0.0
