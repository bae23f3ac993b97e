"""trainer_hooks.losses: hand-computed numerics, gradient direction, TIS, masking, staleness."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_hooks.losses import (
    group_advantages,
    k3_kl,
    policy_loss,
    sequence_log_probs,
    token_log_probs,
)


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 3.0, 1.0])
    adv = group_advantages(r, n=2, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0]))
    # std of [1, 0] (unbiased) = sqrt(0.5); equal rewards -> 0, not NaN.
    adv = group_advantages(r, n=2)
    s = math.sqrt(0.5)
    assert torch.allclose(adv[:2], torch.tensor([0.5, -0.5]) / (s + 1e-6))
    assert torch.equal(adv[2:4], torch.zeros(2))
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize(
    "shape, n, match",
    [((5,), 2, "multiple of n"), ((4,), 0, "n"), ((2, 2), 2, "1-D")],
    ids=["not-a-multiple-of-n", "n-0", "2-D-rewards"],
)
def test_group_advantages_rejects_bad_input(shape, n, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.ones(shape), n=n)


def test_token_log_probs_matches_manual_and_is_fp32():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]]], dtype=torch.bfloat16)
    out = token_log_probs(logits, torch.tensor([[2, 0]]))
    assert out.dtype == torch.float32
    z = math.log(1 + math.e + math.e**2)
    assert torch.allclose(out, torch.tensor([[2.0 - z, -math.log(3)]]), atol=1e-6)
    with pytest.raises(ValueError, match="logits"):
        token_log_probs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))


def test_sequence_log_probs_shift_and_mask():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    tokens = torch.randint(0, 5, (2, 4))
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    out = sequence_log_probs(logits, tokens, mask)
    full = torch.log_softmax(logits, -1)
    for b in range(2):
        for t in range(4):
            want = full[b, t - 1, tokens[b, t]].item() if (t > 0 and mask[b, t]) else 0.0
            assert out[b, t].item() == pytest.approx(want, abs=1e-6)


def test_k3_is_nonnegative_and_zero_on_equal():
    a = torch.randn(100)
    b = torch.randn(100)
    assert (k3_kl(a, b) >= 0).all()
    assert torch.allclose(k3_kl(a, a), torch.zeros(100))


def test_policy_loss_hand_computed_clipping():
    # Two tokens, eps = 0.2. Token 0: ratio e^0.5 ~ 1.65, A = +1 -> clipped at 1.2 (binding).
    # Token 1: ratio e^-0.1 ~ 0.905, A = -2 -> inside the range, unclipped: 2 * 0.905.
    new = torch.tensor([[0.5, -0.1]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(new, old, adv, mask, 0.2, 0.2)
    want = (-1.2 + 2.0 * math.exp(-0.1)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert m["train/clip_fraction"] == pytest.approx(0.5)
    assert m["train/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    # Asymmetric clip (clip-higher): eps_high = 0.7 no longer binds token 0.
    loss, m = policy_loss(new, old, adv, mask, 0.2, 0.7)
    assert loss.item() == pytest.approx((-math.exp(0.5) + 2.0 * math.exp(-0.1)) / 2, rel=1e-6)
    assert m["train/clip_fraction"] == 0.0


def test_policy_loss_negative_advantage_clips_low():
    # A < 0 and ratio 0.5 < 1 - eps: pessimistic bound uses the clipped 0.8 -> loss 0.8 (binding).
    loss, m = policy_loss(
        torch.tensor([[math.log(0.5)]]), torch.zeros(1, 1), torch.tensor([-1.0]),
        torch.ones(1, 1), 0.2, 0.2,
    )  # fmt: skip
    assert loss.item() == pytest.approx(0.8, rel=1e-6)
    assert m["train/clip_fraction"] == 1.0


def _tiny_policy(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(7, 8), torch.nn.Linear(8, 7))
    tokens = torch.randint(0, 7, (3, 6))
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[:, 2:] = True
    mask[2, 5] = False
    return model, tokens, mask


def test_on_policy_gradient_equals_vanilla_policy_gradient():
    """old == behaviour == new (detached) and clip not binding: grad = grad of -mean(A * logp)."""
    model, tokens, mask = _tiny_policy()
    adv = torch.tensor([1.0, -0.5, 2.0])

    logp = sequence_log_probs(model(tokens), tokens, mask)
    loss, _ = policy_loss(
        logp, logp.detach(), adv, mask, 0.2, 0.2, behaviour_logp=logp.detach(), tis_cap=2.0
    )
    grads = torch.autograd.grad(loss, list(model.parameters()))

    logp = sequence_log_probs(model(tokens), tokens, mask)
    vanilla = -(adv[:, None] * logp * mask).sum() / mask.sum()
    ref = torch.autograd.grad(vanilla, list(model.parameters()))
    for g, r in zip(grads, ref, strict=True):
        assert torch.allclose(g, r, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads)


def test_gradient_sign_raises_logp_of_positive_advantage_tokens():
    new = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(new, None, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    (g,) = torch.autograd.grad(loss, new)
    # Gradient descent moves against the gradient: A > 0 tokens get a higher log-prob.
    assert (g[0] < 0).all() and (g[1] > 0).all()


def test_tis_weights_truncate_and_scale_the_loss():
    new = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    beh = torch.tensor([[0.0, -math.log(1.5), -math.log(10.0)]])  # raw w = 1, 1.5, 10
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 3)
    loss, m = policy_loss(new, old, adv, mask, behaviour_logp=beh, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(1.0 + 1.5 + 2.0) / 3, rel=1e-6)
    assert m["train/is_weight_max"] == pytest.approx(2.0)
    assert m["train/is_weight_mean"] == pytest.approx(4.5 / 3, rel=1e-6)
    assert m["mismatch/is_weight_raw_max"] == pytest.approx(10.0, rel=1e-5)
    assert m["mismatch/tis_truncated_frac"] == pytest.approx(1 / 3)
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(math.log(10.0), rel=1e-6)
    (g,) = torch.autograd.grad(loss, new)
    assert torch.allclose(g, -torch.tensor([[1.0, 1.5, 2.0]]) / 3)
    # Without a cap the behaviour log-probs are only measured, not used.
    loss, m = policy_loss(new, old, adv, mask, behaviour_logp=beh)
    assert loss.item() == pytest.approx(-1.0)
    assert m["train/is_weight_max"] == 1.0


def test_masked_tokens_do_not_contribute():
    new = torch.tensor([[0.1, 0.2, 5.0, -7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    loss, m = policy_loss(new, None, torch.tensor([1.0]), mask)
    (g,) = torch.autograd.grad(loss, new)
    assert torch.equal(g[0, 2:], torch.zeros(2))
    assert m["train/tokens"] == 2.0
    # Changing masked values changes nothing.
    loss2, _ = policy_loss(torch.tensor([[0.1, 0.2, -1.0, 9.0]]), None, torch.tensor([1.0]), mask)
    assert loss2.item() == pytest.approx(loss.item())


def test_staleness_bound_masks_tokens():
    new = torch.zeros(1, 4, requires_grad=True)
    stale = torch.tensor([[0, 1, 2, 3]])
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    loss, m = policy_loss(new, None, adv, torch.ones(1, 4), staleness=stale, max_staleness=1)
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2)
    assert m["staleness/masked_token_frac"] == pytest.approx(0.5)
    (g,) = torch.autograd.grad(loss, new)
    assert torch.equal(g[0, 2:], torch.zeros(2))
    with pytest.raises(ValueError, match="staleness"):
        policy_loss(new, None, adv, torch.ones(1, 4), max_staleness=1)


def test_seq_mean_weights_sequences_equally():
    new = torch.zeros(2, 4)
    adv = torch.tensor([1.0, 3.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    tok, _ = policy_loss(new, None, adv, mask, loss_agg="token-mean")
    seq, _ = policy_loss(new, None, adv, mask, loss_agg="seq-mean")
    assert tok.item() == pytest.approx(-(4 * 1.0 + 3.0) / 5)
    assert seq.item() == pytest.approx(-(1.0 + 3.0) / 2)
    # An all-masked sequence is ignored by seq-mean, not counted as zero.
    empty = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    seq, _ = policy_loss(new, None, adv, empty, loss_agg="seq-mean")
    assert seq.item() == pytest.approx(-1.0)


def test_kl_penalty_k3_added_and_pulls_towards_ref():
    new = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-0.5, -1.0]])
    zero = torch.zeros(1)
    loss, m = policy_loss(new, None, zero, torch.ones(1, 2), kl_coef=0.1, ref_logp=ref)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert m["train/kl"] == pytest.approx(k3 / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, rel=1e-6)
    (g,) = torch.autograd.grad(loss, new)
    assert g[0, 0] > 0 and g[0, 1] == 0  # descent lowers logp towards ref
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(new, None, zero, torch.ones(1, 2), kl_coef=0.1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tis_cap": 2.0}, "behaviour_logp"),
        ({"loss_agg": "sum"}, "loss_agg"),
        ({"clip_eps_low": 1.5}, "clip_eps_low"),
        ({"kl_coef": -1.0}, "kl_coef"),
    ],
)
def test_policy_loss_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(1, 2), None, torch.zeros(1), torch.ones(1, 2), **kwargs)


@pytest.mark.parametrize(
    "logp, old_logp, advantages, mask, match",
    [
        ((1, 2), None, (1,), (1, 3), "mask"),
        ((2, 2), None, (3,), (2, 2), "advantages"),
        ((1, 2), (1, 3), (1,), (1, 2), "old_logp"),
    ],
    ids=["mask-shape", "advantages-length", "old-logp-shape"],
)
def test_policy_loss_shape_errors(logp, old_logp, advantages, mask, match):
    old = None if old_logp is None else torch.zeros(old_logp)
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(logp), old, torch.zeros(advantages), torch.ones(mask))


def test_grpo_step_on_real_rollouts():
    """Config builders + RolloutManager + collate + this loss: on-policy, finite, trainable."""
    import random

    from recipes.tasks import get_task
    from rollout.config import load_config
    from rollout.config.builders import (
        inference_config,
        manager_config,
        model_config,
        sampling_params,
    )
    from rollout.metrics import check_keys, staleness_summary
    from rollout.models import build_model
    from rollout.rl.manager import RolloutManager
    from rollout.rl.samples import collate
    from rollout.tokenizers import ByteTokenizer

    run = load_config(["rollout.samples_per_prompt=4", "rollout.max_new_tokens=6"])
    tok = ByteTokenizer()
    model = build_model(model_config(run, tok.vocab_size))
    task = get_task(run.recipe.task, **run.recipe.task_kwargs)
    examples = {ex.prompt: ex for ex in task.sample_prompts(2, random.Random(0))}
    sp = sampling_params(run, stop_token_ids=[tok.eos_id])
    with RolloutManager(
        manager_config(run), model=model, tokenizer=tok, inference_config=inference_config(run)
    ) as mgr:
        samples = mgr.generate(list(examples), n=4, sampling_params=sp)
    assert len(samples) == 8
    for s in samples:
        # The untrained model rarely scores; reward digits so advantages are non-zero.
        s.reward = task.reward_tokens(s.completion_tokens, examples[s.prompt], tok) + sum(
            48 <= t <= 57 for t in s.completion_tokens
        )
    batch = collate(samples, pad_id=tok.pad_id)
    mask = batch["completion_mask"]
    logp = sequence_log_probs(model(batch["tokens"]), batch["tokens"], mask)
    # On-policy fidelity: the trainer's log-probs equal the engine's behaviour log-probs.
    assert ((logp - batch["behaviour_logp"]).abs() * mask).max().item() <= 1e-5
    adv = group_advantages(batch["rewards"], n=4)
    loss, metrics = policy_loss(
        logp, None, adv, mask, behaviour_logp=batch["behaviour_logp"], tis_cap=2.0,
        staleness=batch["policy_staleness"], max_staleness=run.rollout.max_staleness,
    )  # fmt: skip
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0 or bool((adv == 0).all())
    assert metrics["train/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    check_keys(metrics)
    check_keys(staleness_summary([torch.tensor(s.policy_staleness) for s in samples]))


def test_token_log_probs_chunking_matches_log_softmax_and_backprops():
    torch.manual_seed(1)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    want = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    got = token_log_probs(logits, targets, chunk_tokens=4)  # 15 positions: 4 chunks
    assert torch.allclose(got, want, atol=1e-6)
    (g,) = torch.autograd.grad(got.sum(), logits)
    (w,) = torch.autograd.grad(want.sum(), logits)
    assert torch.allclose(g, w, atol=1e-6)
    assert token_log_probs(torch.zeros(0, 4, 3), torch.zeros(0, 4, dtype=torch.long)).shape == (
        0,
        4,
    )


def test_garbage_at_masked_positions_cannot_make_nan():
    """Prompt/padding positions may hold anything; exp() overflow there must not leak NaN."""
    new = torch.tensor([[0.1, 200.0, -0.2]], requires_grad=True)
    beh = torch.tensor([[0.0, -300.0, -0.1]])
    ref = torch.tensor([[0.0, 500.0, 0.0]])
    mask = torch.tensor([[True, False, True]])
    loss, m = policy_loss(
        new, torch.tensor([[0.0, -100.0, 0.0]]), torch.tensor([1.0]), mask,
        behaviour_logp=beh, tis_cap=2.0, kl_coef=0.1, ref_logp=ref,
    )  # fmt: skip
    (g,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and g[0, 1] == 0
    assert all(math.isfinite(v) for v in m.values())
    assert m["mismatch/logp_abs_diff_max"] == pytest.approx(0.1, rel=1e-5)
