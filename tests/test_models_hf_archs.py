"""Qwen3, Qwen3-MoE, Qwen2-MoE and Mistral checkpoints saved by transformers: the engine's greedy
tokens equal transformers' `generate()` and its log-probs equal transformers' within 1e-5, from
the folder, after a weight update from the HF model object, and in engine processes; what the
model cannot honour is refused by name."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from near_tie import assert_matches_reference, top2_rows
from proc_io import read_until, stop_all

from rollout import LLM, InferenceConfig, SamplingParams
from rollout.models import (
    ModelConfig,
    build_model,
    from_transformers,
    load_pretrained,
    save_pretrained,
)
from rollout.models.moe import Experts, Router
from rollout.serving.client import InferenceClient
from rollout.tokenizers import ByteTokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)

TOLERANCE = 1e-5
VOCAB = 101
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}  # fmt: skip
# case -> (HF config class, HF model class, config kwargs, shard bytes or None)
CASES = {
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_parameters=YARN), None),
    "qwen3-tied-sharded": ("Qwen3Config", "Qwen3ForCausalLM",
                           dict(tie_word_embeddings=True, attention_bias=True), 20_000),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(MOE, norm_topk_prob=True, mlp_only_layers=[1]), 30_000),
    "qwen3-moe-sparse-step-tied": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                   dict(MOE, decoder_sparse_step=2, tie_word_embeddings=True), None),
    "qwen2-moe-shared-expert": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                                dict(MOE, shared_expert_intermediate_size=24), None),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(sliding_window=4096, head_dim=8,
                     rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
                None),
}  # fmt: skip
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1], [60, 2, 33], list(range(10, 40))]
NEW_TOKENS = 12


def make_hf(case: str, seed: int = 0):
    cfg_cls, model_cls, extra, _ = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    model = getattr(transformers, model_cls)(cfg)
    _perturb(model, seed, std=0.2)  # large weights: peaked distributions, any mismatch shows
    return model.eval()


def _perturb(model: torch.nn.Module, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))


def save_hf(case: str, model, path) -> None:
    shard = CASES[case][3]
    model.save_pretrained(path, max_shard_size=shard if shard is not None else "1GB")


def hf_reference(model, prompt: list[int]) -> tuple[list[int], list[float], list[dict]]:
    """transformers' greedy tokens, their log-probs and each step's top-2 (for the near-tie rule:
    another implementation's floats; tests/near_tie.py), from one forward over the sequence."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
        )
        logits = model(out).logits.float().log_softmax(-1)[0]
    gen = out[0, len(prompt) :].tolist()
    lps = [logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(gen)]
    return gen, lps, top2_rows(logits[len(prompt) - 1 : len(prompt) - 1 + len(gen)])


def assert_engine_matches(llm: LLM, hf) -> None:
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS, return_log_probs=True,
                        ignore_eos=True)  # fmt: skip
    for prompt, req in zip(PROMPTS, llm.generate(PROMPTS, sp), strict=True):
        tokens, lps, top2 = hf_reference(hf, prompt)
        n = assert_matches_reference(req.generated_tokens, tokens, top2)
        diff = max(
            (abs(a - b) for a, b in zip(req.generated_log_probs[:n], lps[:n], strict=True)),
            default=0,
        )
        assert diff <= TOLERANCE, diff


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_matches_transformers_before_and_after_a_weight_update(tmp_path, case):
    hf = make_hf(case)
    save_hf(case, hf, tmp_path)
    model, config = load_pretrained(tmp_path)
    assert config.architecture == CASES[case][1].removesuffix("ForCausalLM").lower().replace(
        "moe", "_moe"
    )
    if CASES[case][3] is not None:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    llm = LLM(
        model,
        None,
        InferenceConfig(
            block_size=8,
            num_blocks=64,
            max_tokens_per_step=16,
            max_requests=8,
            max_sequence_length=128,
        ),
    )  # chunked prefill
    assert_engine_matches(llm, hf)
    _perturb(hf, seed=7, std=0.2)  # the trainer's step; its HF state dict is the update
    llm.engine.update_weights(hf.state_dict(), 1)
    assert_engine_matches(llm, hf)


def test_from_transformers_copies_the_model_and_refuses_other_architectures():
    hf = make_hf("qwen2-moe-shared-expert")
    ours, config = from_transformers(hf)
    assert config.shared_expert_intermediate_size == 24 and config.architecture == "qwen2_moe"
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-5)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        from_transformers(gpt2)
    with pytest.raises(ValueError, match="from_transformers"):
        LLM(hf, None)  # the engine runs its own model class


def test_round_trip_through_our_saver_loads_in_transformers(tmp_path):
    """save_pretrained writes experts one by one (transformers' disk layout) and a config
    transformers reads: both models give the same logits."""
    hf = make_hf("qwen2-moe-shared-expert")
    save_hf("qwen2-moe-shared-expert", hf, tmp_path / "a")
    ours, config = load_pretrained(tmp_path / "a")
    save_pretrained(ours, config, tmp_path / "b", max_shard_bytes=30_000)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids), rtol=0, atol=1e-5)
    assert config.num_parameters() == sum(p.numel() for p in ours.parameters())


def test_moe_grouped_forward_equals_a_per_token_reference_and_the_static_path():
    torch.manual_seed(0)
    router, experts = Router(16, 6, 3, norm_topk_prob=True), Experts(6, 16, 8)
    for p in (router.weight, experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(40, 16)
    weights, idx = router(x)
    got = experts(x, weights, idx)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):  # the definition, one token at a time
        for w, e in zip(weights[t], idx[t], strict=True):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            want[t] += w * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(experts.forward_static(x, weights, idx), want, rtol=0, atol=1e-5)
    # replay: given experts are used as they are, weighted by this router's probabilities
    replay_w, replay_idx = router(x, chosen=idx.flip(-1))
    assert torch.equal(replay_idx, idx.flip(-1))
    torch.testing.assert_close(replay_w, weights.flip(-1))


def test_static_decode_matches_paged_for_moe():
    config = ModelConfig(architecture="qwen3_moe", **{k: v for k, v in BASE.items()
                                                      if k != "pad_token_id"}, **MOE)  # fmt: skip
    model = build_model(config, seed=0).eval()
    from rollout.models.attention import PagedAttentionMetadata, StaticDecodePlan

    kv = torch.zeros(2, config.num_hidden_layers, 8, 8, config.num_key_value_heads, config.head_dim)
    meta = PagedAttentionMetadata.from_lists([1, 1], [1, 1], [[0], [1]], block_size=8)
    ids, pos = torch.tensor([3, 9]), torch.tensor([0, 0])
    want = model.forward_paged(ids, pos, meta, kv.clone())
    plan = StaticDecodePlan(meta.slot_mapping, meta.block_tables, meta.context_lens)
    torch.testing.assert_close(model.forward_static_decode(ids, pos, plan, kv.clone()), want)


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"architectures": ["GemmaForCausalLM"]}, "GemmaForCausalLM"),
        ({"architectures": ["Qwen3ForCausalLM"], "hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
        ({"architectures": ["Qwen3ForCausalLM"],
          "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"architectures": ["LlamaForCausalLM"],
          "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"architectures": ["Qwen3ForCausalLM"], "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 0}, "num_experts"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 5,
          "moe_intermediate_size": 8}, "num_experts_per_tok=5"),
        ({"architectures": ["Qwen3ForCausalLM"],
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "missing"),
    ],
    ids=["architecture", "activation", "qwen-sliding-window", "longrope", "dynamic-rope",
         "partial-rotary", "moe-without-experts", "top-k-above-experts", "yarn-without-factor"],
)  # fmt: skip
def test_unsupported_configs_are_refused_by_name(hf, match):
    base = {k: v for k, v in BASE.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**base, **hf})


def test_mistral_sliding_window_shorter_than_served_sequences_is_refused(tmp_path):
    hf = make_hf("mistral")
    hf.config.sliding_window = 64
    save_hf("mistral", hf, tmp_path)
    model, config = load_pretrained(tmp_path)
    assert config.sliding_window == 64
    with pytest.raises(ValueError, match="sliding_window=64"):
        LLM(model, None, InferenceConfig(max_sequence_length=128, num_blocks=16))
    LLM(
        model, None, InferenceConfig(max_sequence_length=64, max_tokens_per_step=64, num_blocks=16)
    )  # fits


def test_config_json_round_trips_for_every_architecture(tmp_path):
    for case in CASES:
        hf = make_hf(case)
        save_hf(case, hf, tmp_path / case)
        config = ModelConfig.from_hf(json.loads((tmp_path / case / "config.json").read_text()))
        assert ModelConfig.from_hf(config.to_hf()) == config


def test_engine_processes_match_transformers_across_an_update_from_the_hf_model():
    """Coordinator mode started from the trainer's transformers model object (engines load a
    converted copy in their own processes); `update_weights` takes that object itself."""
    hf = make_hf("qwen3-moe")
    cfg = InferenceConfig(block_size=8, num_blocks=64, max_requests=8, max_tokens_per_step=64,
                          max_sequence_length=128)  # fmt: skip
    llm = LLM(hf, None, cfg, use_coordinator=True)
    try:
        assert_engine_matches(llm, hf)
        _perturb(hf, seed=11, std=0.2)
        acks = llm.update_weights(hf, 1)
        assert {a["weight_version"] for a in acks.values()} == {1}
        assert_engine_matches(llm, hf)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", ["qwen3-yarn", "qwen3-moe", "mistral"])
def test_rollout_serve_matches_transformers(tmp_path, case):
    """Each architecture family served by `rollout serve` from its HF folder, as a user runs it."""
    hf = make_hf(case)
    save_hf(case, hf, tmp_path)
    ByteTokenizer().save(tmp_path)  # token-id prompts below; the folder needs some tokenizer
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "rollout.cli", "serve", "--model", str(tmp_path), "--dp", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        address = read_until(serve, r"coordinator (tcp://\S+) pid")[1]
        token_file = read_until(serve, r"auth token file (\S+)")[1]
        read_until(serve, r"^ready")
        token = Path(token_file).read_text().strip()
        sp = SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS,
                            return_log_probs=True, ignore_eos=True)  # fmt: skip

        async def generate() -> list:
            client = await InferenceClient(address, auth_token=token).start()
            try:
                recs = await asyncio.gather(*[client.add_request(p, sp) for p in PROMPTS])
                return [r.merge() for r in recs]
            finally:
                client.stop()

        for prompt, req in zip(PROMPTS, asyncio.run(generate()), strict=True):
            tokens, lps, top2 = hf_reference(hf, prompt)
            n = assert_matches_reference(req.generated_tokens, tokens, top2)
            got = req.generated_log_probs[:n]
            diff = max((abs(a - b) for a, b in zip(got, lps[:n], strict=True)), default=0)
            assert diff <= TOLERANCE, diff
    finally:
        stop_all([serve])


def test_recipe_config_hf_dir_builds_a_trainable_moe(tmp_path):
    """`model=hf_dir model.path=...` on a Qwen3-MoE folder: the trainer gets the engine's model
    class with the checkpoint's weights, and gradients reach the router and the experts."""
    from rollout.config import load_config
    from rollout.config.builders import build_model_and_tokenizer

    hf = make_hf("qwen3-moe")
    hf.config.vocab_size = 260  # room for the byte tokenizer's ids
    hf.resize_token_embeddings(260)
    save_hf("qwen3-moe", hf, tmp_path)
    ByteTokenizer().save(tmp_path)
    run = load_config(["model=hf_dir", f"model.path={tmp_path}", "model.device=cpu",
                       "model.dtype=float32"])  # fmt: skip
    model, tok, mc = build_model_and_tokenizer(run)
    assert mc.architecture == "qwen3_moe" and model.training and tok.vocab_size == 259
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=0, atol=1e-5)
    model(ids).logsumexp(-1).sum().backward()
    layer = model.model.layers[0].mlp
    assert layer.gate.weight.grad.abs().sum() > 0 and layer.experts.down_proj.grad.abs().sum() > 0


def test_per_expert_names_stack_and_split_and_a_missing_expert_is_named():
    from rollout.models.names import split_experts, stack_experts

    hf = make_hf("qwen3-moe")
    ours, _ = from_transformers(hf)
    stacked = dict(ours.state_dict())
    per_expert = split_experts(stacked)  # the disk / transformers 4.x layout
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in per_expert
    assert not any(k.endswith("experts.gate_up_proj") for k in per_expert)
    back = stack_experts(per_expert, num_experts=8)
    assert back.keys() == stacked.keys()
    assert all(torch.equal(back[k], stacked[k]) for k in stacked)
    del per_expert["model.layers.2.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts.*3.down_proj"):
        stack_experts(per_expert, num_experts=8)
