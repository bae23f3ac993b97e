"""The trainer's forward under `trainer_hooks.batch_invariant.enabled()` gives the engine's
behaviour log-probs bit for bit (torch.equal), with gradients, for our DecoderLM and for
transformers' Llama, Qwen2, Qwen3, Qwen3-MoE (routing replay) and Mistral; and refuses by name
what it cannot reproduce.

Each family is a tiny random checkpoint written by transformers' `save_pretrained`; the engine
loads the folder (`load_pretrained`) and samples at temperature 0.7 with chunked prefill and
mixed-length prompts in one batch; the trainer runs the transformers model object itself on
the right-padded batch, in two micro-batches of different padding. Qwen2-MoE (shared expert),
bf16 and a PEFT LoRA policy are covered too.
"""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch

from recipes.common import run_recipe
from rollout import LLM, InferenceConfig, SamplingParams
from rollout.config import compose
from rollout.models import batch_invariant as bi
from rollout.models import build_model, from_transformers, load_pretrained
from rollout.models.config import ModelConfig
from rollout.rl.samples import Sample, collate
from trainer_hooks.batch_invariant import BatchInvariantUnsupported, enabled, is_enabled
from trainer_hooks.losses import policy_loss, sequence_log_probs
from trainer_hooks.routing_replay import replay_routing

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB = 101
TEMPERATURE = 0.7
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
# family -> (config class, model class, config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, mlp_only_layers=[1])),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096, head_dim=8)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(MOE, shared_expert_intermediate_size=24)),
}  # fmt: skip
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1, 60, 2, 33, 8, 9, 10, 11, 12, 13, 14, 15], [60, 2, 33],
           list(range(10, 31)), [4, 4]]  # fmt: skip
NEW_TOKENS = 7


def make_hf(family: str, seed: int = 0) -> torch.nn.Module:
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**BASE, **extra))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # large weights: peaked distributions, any mismatch shows
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model


def engine(model: torch.nn.Module, invariant: bool = True) -> LLM:
    cfg = InferenceConfig(block_size=8, num_blocks=64, max_tokens_per_step=16, max_requests=8,
                          max_sequence_length=128, batch_invariant=invariant)  # fmt: skip
    return LLM(model, None, cfg)


def rollout_batch(llm: LLM, moe: bool = False) -> dict[str, torch.Tensor]:
    """Sampled completions of PROMPTS (all in flight at once, chunked prefill), collated."""
    sp = SamplingParams(temperature=TEMPERATURE, num_tokens_to_generate=NEW_TOKENS, seed=11,
                        return_log_probs=True, ignore_eos=True, return_routed_experts=moe,
                        logprobs_mode="processed")  # fmt: skip
    samples = []
    for i, req in enumerate(llm.generate(PROMPTS, sp)):
        n = len(req.generated_tokens)
        samples.append(Sample(
            group_id=i, index=0, request_id=req.request_id, prompt=None,
            prompt_tokens=req.prompt_tokens.tolist(), completion_tokens=list(req.generated_tokens),
            completion_text=None, logprobs=list(req.generated_log_probs),
            policy_staleness=[0] * n, kv_staleness=[0] * n, token_versions=[0] * n,
            kv_versions=[0] * n, weight_versions=[0], finish_reason=req.stop_reason,
            routed_experts=torch.stack(req.routed_experts) if moe else None,
            prompt_routed_experts=req.prompt_routed_experts if moe else None,
        ))  # fmt: skip
    return collate(samples)


def trainer_logprobs(model, batch, hf: bool, replay: bool = False) -> torch.Tensor:
    """[B, T] log-probs from a forward WITH gradients, in two micro-batches (rows 0-1, 2-3),
    each cut to its own longest row; backward runs, and every weight gets a gradient."""
    out = torch.zeros(batch["tokens"].shape)
    model.zero_grad(set_to_none=True)
    for rows in (slice(0, 2), slice(2, 4)):
        mask = batch["completion_mask"][rows]
        t = int(mask.any(0).nonzero().max()) + 1
        tokens, mask = batch["tokens"][rows, :t], mask[:, :t]
        with enabled():
            if replay:
                experts = batch["routed_experts"][rows, :t]
                with replay_routing(model, experts, batch["routed_experts_mask"][rows, :t]):
                    logits = model(tokens).logits
            else:
                logits = model(tokens).logits if hf else model(tokens)
            lp = sequence_log_probs(logits, tokens, mask, temperature=TEMPERATURE)
        assert lp.requires_grad
        lp.sum().backward()
        out[rows, :t] = lp.detach()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return out


def assert_bitwise(trainer: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
    m = batch["completion_mask"]
    assert int(m.sum()) == NEW_TOKENS * len(PROMPTS)
    assert torch.equal(trainer[m], batch["behaviour_logp"][m])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_forward_equals_the_engines_behaviour_logprobs(tmp_path, family):
    hf = make_hf(family)
    hf.save_pretrained(tmp_path)
    model, _ = load_pretrained(tmp_path)
    moe = family.endswith("moe")
    batch = rollout_batch(engine(model), moe=moe)
    hf.train()  # dropout is 0 in these configs: train mode changes nothing
    assert_bitwise(trainer_logprobs(hf, batch, hf=True, replay=moe), batch)
    if moe:  # re-routing gives the same experts too: the router's bits are the engine's
        assert_bitwise(trainer_logprobs(hf, batch, hf=True), batch)


def test_own_decoder_lm_forward_equals_the_engines_behaviour_logprobs():
    config = ModelConfig.preset("tiny", vocab_size=VOCAB)
    trainer = build_model(config, seed=0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(4.0 if p.dim() == 2 else 1.0)  # peaked, like a trained model
    batch = rollout_batch(engine(copy.deepcopy(trainer)))
    assert_bitwise(trainer_logprobs(trainer, batch, hf=False), batch)


def test_bf16_and_a_peft_lora_policy_equal_the_engine_too(tmp_path):
    """A bf16 Qwen3 (the engine's and the trainer's dtype) and a PEFT LoRA policy (the engine
    applies the adapter unmerged; the trainer runs PEFT's modules). bf16 as transformers loads
    it: `model.to(torch.bfloat16)` would also round RoPE's fp32 inv_freq buffer."""
    make_hf("qwen3").save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert hf.dtype == torch.bfloat16
    batch = rollout_batch(engine(from_transformers(hf)[0]))
    assert_bitwise(trainer_logprobs(hf, batch, hf=True), batch)
    peft = pytest.importorskip("peft")
    policy = peft.get_peft_model(
        make_hf("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    with torch.no_grad():  # PEFT starts B at zero: give the adapter a term
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
    batch = rollout_batch(engine(from_transformers(policy)[0]))
    assert_bitwise(trainer_logprobs(policy, batch, hf=True), batch)


def test_a_plain_causal_sdpa_call_is_the_canonical_attention():
    """A model of one's own calling F.scaled_dot_product_attention(is_causal=True) gets the
    engine's attention; other calls are refused by name."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 19, 8, generator=g) for _ in range(3))
    with enabled():
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        with pytest.raises(BatchInvariantUnsupported, match="scaled_dot_product_attention"):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
    pos = torch.arange(19).expand(2, 19)
    want = bi.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, 8**-0.5)
    assert torch.equal(got, want.transpose(1, 2))


def test_without_the_mode_the_trainer_differs():
    """Negative control: the same engine bits, the trainer's default kernels."""
    hf = make_hf("llama")
    batch = rollout_batch(engine(from_transformers(hf)[0]))
    m = batch["completion_mask"]
    with torch.no_grad():
        lp = sequence_log_probs(hf(batch["tokens"]).logits, batch["tokens"], m, TEMPERATURE)
    assert not torch.equal(lp[m], batch["behaviour_logp"][m])
    torch.testing.assert_close(lp[m], batch["behaviour_logp"][m], rtol=0, atol=1e-4)


def test_policy_loss_reports_zero_mismatch_on_fresh_tokens_only():
    beh = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    old = torch.tensor([[0.0, -1.0, -2.5, -3.0]])  # token 2 was sampled by an older version
    mask = torch.tensor([[False, True, True, True]])
    staleness = torch.tensor([[0, 0, 1, 0]])
    _, m = policy_loss(old, old, torch.ones(1), mask, behaviour_logp=beh, staleness=staleness)
    assert m["mismatch/logprob_abs_diff_max"] == 0.0
    assert m["mismatch/logp_abs_diff_max"] == 0.5
    _, m = policy_loss(old, old, torch.ones(1), mask, behaviour_logp=beh)
    assert m["mismatch/logprob_abs_diff_max"] == 0.5


def test_a_row_alone_equals_the_row_inside_any_batch():
    """The trainer side alone: a row's log-probs do not depend on the batch around it."""
    hf = make_hf("qwen3_moe")
    tokens = torch.randint(0, VOCAB, (6, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), enabled():
        full = sequence_log_probs(hf(tokens).logits, tokens, temperature=TEMPERATURE)
        for rows in ([3], [3, 0], [5, 3, 1]):
            part = sequence_log_probs(
                hf(tokens[rows]).logits, tokens[rows], temperature=TEMPERATURE
            )
            assert torch.equal(part[rows.index(3)], full[3])


def test_refuses_by_name_what_it_cannot_reproduce():
    hf = make_hf("llama").eval()
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    left_padded = torch.ones_like(tokens)
    left_padded[0, :3] = 0
    with enabled(), torch.no_grad():
        with pytest.raises(BatchInvariantUnsupported, match="left padding"):
            hf(tokens, attention_mask=left_padded)
        with pytest.raises(BatchInvariantUnsupported, match="position_ids"):
            hf(tokens, position_ids=torch.arange(5, 17)[None].expand(2, -1))
        with pytest.raises(BatchInvariantUnsupported, match="KV cache"):
            hf.generate(tokens[:1], max_new_tokens=2, do_sample=False)
        right_padded = torch.ones_like(tokens)
        right_padded[1, 9:] = 0  # right padding is fine: the valid rows are the same bits
        a = hf(tokens, attention_mask=right_padded).logits
        assert torch.equal(a[1, :9], hf(tokens[1:, :9]).logits[0])
    windowed = make_hf("mistral")
    windowed.config.sliding_window = 4
    with enabled(), pytest.raises(BatchInvariantUnsupported, match="sliding_window"):
        windowed(tokens)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))
    with enabled(), pytest.raises(BatchInvariantUnsupported, match="GPT2Attention"):
        gpt2(tokens)


def test_patches_are_thread_local_and_restored():
    from transformers.modeling_utils import AttentionInterface

    original = AttentionInterface.__dict__["get_interface"]
    hf = make_hf("qwen2").eval()
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = hf(tokens).logits
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        inside.wait(30)
        assert not is_enabled()
        with torch.no_grad():
            seen["logits"] = hf(tokens).logits
        outside.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with enabled():
        assert is_enabled() and AttentionInterface.__dict__["get_interface"] is not original
        inside.set()
        assert outside.wait(60)
    thread.join()
    assert torch.equal(seen["logits"], plain)  # the other thread ran transformers' own path
    assert AttentionInterface.__dict__["get_interface"] is original and not is_enabled()


# -- the recipes -----------------------------------------------------------------------------------

RECIPE_TINY = [
    "trainer.steps=3", "trainer.warmup_sft_steps=20", "trainer.batch=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
    "recipe.eval_every=0", "logger=disabled", "rollout.batch_invariant=true",
]  # fmt: skip


def _train_rows(overrides: list[str], tmp_path) -> list[dict]:
    run_recipe(compose([*overrides, f"logger.dir={tmp_path}"]))
    history = json.loads((tmp_path / "metrics.json").read_text())["history"]
    return [r for r in history if "train/loss" in r]


def test_recipe_logs_a_mismatch_of_exactly_zero_at_every_step(tmp_path):
    rows = _train_rows(RECIPE_TINY, tmp_path)
    assert len(rows) == 3
    for r in rows:  # micro-batches of 4: every step's max is over two trainer forwards
        assert r["mismatch/logprob_abs_diff_max"] == 0.0 and r["train/tokens"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_main_job_learns_with_zero_mismatch(tmp_path):
    """scripts/main.sh's recipe (grpo_reverse as shipped) with fewer steps, mode on: greedy
    exact match rises by >= 0.4 and the mismatch is exactly 0.0 at every step."""
    rows = _train_rows(["recipe=grpo_reverse", "trainer.steps=100", "logger=disabled",
                        "rollout.batch_invariant=true"], tmp_path)  # fmt: skip
    summary = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    assert len(rows) == 100 and all(r["mismatch/logprob_abs_diff_max"] == 0.0 for r in rows)
    assert summary["end_eval_accuracy"] >= summary["start_eval_accuracy"] + 0.4, summary
