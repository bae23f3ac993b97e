"""LoRA adapters applied without merging (rollout.models.lora): a PEFT adapter folder loads and
matches PEFT's own forward; after an adapter-only update the engine's greedy tokens equal a
merged model's (PEFT `merge_and_unload()` run by transformers) and its log-probs are within
1e-5, in the paged, packed and static-decode paths, in the embedded engine and in dp=2 engine
processes; each update moves the adapter's bytes only; what cannot be applied is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from near_tie import assert_matches_reference, top2_rows

from rollout import LLM, InferenceConfig, SamplingParams
from rollout.models import from_transformers, load_pretrained
from rollout.models.lora import (
    LoraLinear,
    LoraSpec,
    adapter_state_dict,
    apply_lora,
    from_peft_names,
    load_adapter,
    lora_spec,
    save_adapter,
)
from rollout.models.packed import _OPS as packed_ops
from rollout.rl.manager import RolloutManager
from rollout.weights.layout import plan_layout
from rollout.weights.snapshot import WeightSnapshot
from rollout.weights.state import as_state_dict

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(240)

TOLERANCE = 1e-5
NEW_TOKENS = 10
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 1], [60, 2, 33], list(range(10, 30))]
BASE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ICFG = dict(block_size=8, num_blocks=64, max_tokens_per_step=16, max_requests=8,
            max_sequence_length=128)  # fmt: skip


def make_peft(arch: str = "qwen3", seed: int = 0, rslora: bool = False, r: int = 4,
              alpha: float = 8):  # fmt: skip
    """A random-weight HF model wrapped by PEFT, its adapter zero (B=0) as PEFT initialises it."""
    torch.manual_seed(seed)
    if arch == "qwen2-moe":  # LoRA on attention and the shared expert; experts are stacked
        cfg = transformers.Qwen2MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=16,
                                          shared_expert_intermediate_size=24)  # fmt: skip
        hf = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**BASE, head_dim=16))
    _perturb(hf, seed, std=0.2, lora=False)
    lc = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=ALL, use_rslora=rslora,
                         lora_dropout=0.0)  # fmt: skip
    return peft.get_peft_model(hf.eval(), lc).eval()


def _perturb(model: torch.nn.Module, seed: int, std: float, lora: bool) -> None:
    """The trainer's step: the LoRA tensors (lora=True) or the base weights only."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ("lora_" in n) == lora:
                p.add_(torch.randn(p.shape, generator=g) * std)


def merged_reference(peft_model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, log-probs and each step's top-2 (the near-tie rule: merged
    weights round differently; tests/near_tie.py) on the merged model (PEFT's merge_and_unload)."""
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = merged.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)  # fmt: skip
        logits = merged(out).logits.float().log_softmax(-1)[0]
    gen = out[0, len(prompt) :].tolist()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(gen)]
    return gen, [logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(gen)], top2_rows(rows)


GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=NEW_TOKENS,
                        return_log_probs=True, ignore_eos=True)  # fmt: skip


def assert_matches_merged(llm: LLM | RolloutManager, peft_model) -> None:
    if isinstance(llm, RolloutManager):
        got = [(s.completion_tokens, s.logprobs) for s in llm.generate(PROMPTS, 1, GREEDY)]
    else:
        got = [(r.generated_tokens, r.generated_log_probs) for r in llm.generate(PROMPTS, GREEDY)]
    for prompt, (tokens, lps) in zip(PROMPTS, got, strict=True):
        want_tokens, want_lps, top2 = merged_reference(peft_model, prompt)
        n = assert_matches_reference(tokens, want_tokens, top2)
        diff = max((abs(a - b) for a, b in zip(lps[:n], want_lps[:n], strict=True)), default=0)
        assert diff <= TOLERANCE, diff


def adapter_bytes(peft_model) -> int:
    return sum(t.numel() * t.element_size() for t in as_state_dict(peft_model).values())


def test_peft_adapter_folder_loads_unmerged_and_matches_peft(tmp_path):
    pm = make_peft(rslora=True)
    _perturb(pm, seed=3, std=0.2, lora=True)
    copy.deepcopy(pm).unload().save_pretrained(tmp_path / "base")  # the base checkpoint
    pm.save_pretrained(tmp_path / "adapter")  # PEFT's own adapter folder
    model, _ = load_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    assert lora_spec(model).scale == pytest.approx(8 / 2)  # rslora: alpha / sqrt(r)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        diff = (model(ids) - pm(ids).logits).abs().max().item()
    assert diff <= TOLERANCE
    base, _ = load_pretrained(tmp_path / "base")  # the base weights are untouched
    for name, p in base.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name]), name
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoraLinear)
    assert_matches_merged(LLM(model, None, InferenceConfig(**ICFG)), pm)
    save_adapter(model, tmp_path / "again")  # our folder loads in PEFT too
    again = peft.PeftModel.from_pretrained(copy.deepcopy(pm).unload(), tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, pm(ids).logits)


@pytest.mark.parametrize(
    ("arch", "weight_update"), [("qwen3", "pause"), ("qwen2-moe", "pause"), ("qwen3", "staged")]
)
def test_adapter_only_updates_in_the_embedded_engine_equal_the_merged_model(arch, weight_update):
    """The trainer hooks' path: `RolloutManager.update_weights(peft_model)` pushes the adapter
    alone (copied in place, or staged and flipped); a later base-weight update keeps it."""
    pm = make_peft(arch)
    model, _ = from_transformers(pm)
    icfg = InferenceConfig(**ICFG, weight_update=weight_update)
    manager = RolloutManager(model=model, inference_config=icfg)
    try:
        for step in (1, 2):
            _perturb(pm, seed=step, std=0.2, lora=True)
            assert manager.update_weights(pm) == step
            assert manager.stats()["weight_sync/bytes"] == adapter_bytes(pm)
            assert_matches_merged(manager, pm)
        _perturb(pm, seed=9, std=0.05, lora=False)  # a full update of the base alone
        base = {n.replace(".base_layer.", "."): t for n, t in pm.get_base_model().state_dict().items()
                if "lora_" not in n}  # fmt: skip
        manager.update_weights(base)
        assert_matches_merged(manager, pm)
        assert manager.engine.weight_version == 3
    finally:
        manager.close()


def test_trainer_hooks_push_a_peft_models_adapter():
    from trainer_hooks.hooks import RolloutHooks

    pm = make_peft()
    model, _ = from_transformers(pm)
    manager = RolloutManager(model=model, inference_config=InferenceConfig(**ICFG))
    try:
        hooks = RolloutHooks(manager, model=pm)
        _perturb(pm, seed=2, std=0.2, lora=True)
        hooks.on_step_end(0)
        assert hooks.metrics["rollout/version"] == 1
        assert manager.stats()["weight_sync/bytes"] == adapter_bytes(pm)
        assert_matches_merged(manager, pm)
    finally:
        manager.close()


def test_paged_packed_and_static_decode_paths_add_the_adapter():
    """The MKL-packed base plus the adapter's term, and the fixed-shape (CUDA-graph) decode,
    equal the dense forward."""
    pm = make_peft()
    _perturb(pm, seed=4, std=0.2, lora=True)
    model, _ = from_transformers(pm)
    llm = LLM(model, None, InferenceConfig(**ICFG))
    sp = SamplingParams(temperature=0.0, num_tokens_to_generate=24, return_log_probs=True,
                        ignore_eos=True)  # fmt: skip
    reqs = llm.generate(PROMPTS, sp)
    if packed_ops is not None:  # MKL: the decode steps ran on packed base weights
        assert model.packed.rows == len(PROMPTS)
    for prompt, req in zip(PROMPTS, reqs, strict=True):
        seq = torch.tensor([prompt + req.generated_tokens])
        with torch.no_grad():
            lp = model(seq).log_softmax(-1)[0, len(prompt) - 1 : -1]
        ref = lp.gather(-1, torch.tensor(req.generated_tokens)[:, None])[:, 0]
        # the dense forward's own picks, up to its first near tie (tests/near_tie.py)
        assert_matches_reference(req.generated_tokens, lp.argmax(-1).tolist(), top2_rows(lp))
        assert (ref - torch.tensor(req.generated_log_probs)).abs().max().item() <= TOLERANCE


def test_static_decode_equals_paged_and_dense_with_an_adapter():
    from rollout.models.attention import PagedAttentionMetadata, StaticDecodePlan

    pm = make_peft("qwen2-moe")
    _perturb(pm, seed=5, std=0.2, lora=True)
    model, config = from_transformers(pm)
    kv = torch.zeros(2, config.num_hidden_layers, 8, 8, config.num_key_value_heads, config.head_dim)
    meta = PagedAttentionMetadata.from_lists([1, 1], [1, 1], [[0], [1]], block_size=8)
    ids, pos = torch.tensor([3, 9]), torch.tensor([0, 0])
    paged = model.compute_logits(model.forward_paged(ids, pos, meta, kv.clone()))
    plan = StaticDecodePlan(meta.slot_mapping, meta.block_tables, meta.context_lens)
    static = model.compute_logits(model.forward_static_decode(ids, pos, plan, kv.clone()))
    with torch.no_grad():
        dense, ref = model(ids[:, None])[:, 0], pm(ids[:, None]).logits[:, 0]
    torch.testing.assert_close(static, paged)
    torch.testing.assert_close(paged, dense, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(dense, ref, atol=TOLERANCE, rtol=0)


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_dp2_engine_processes_take_adapter_only_updates(tmp_path):
    """Coordinator mode, two engine processes started from the PEFT model (base folder plus
    adapter folder); each update moves the adapter's bytes only, through ipc and broadcast."""
    pm = make_peft()
    llm = LLM(pm, None, InferenceConfig(**ICFG), use_coordinator=True, data_parallel_size=2)
    try:
        assert_matches_merged(llm, pm)
        for version, transport in ((1, "ipc"), (2, "broadcast")):
            llm.cluster.sync.transport = transport
            _perturb(pm, seed=version, std=0.2, lora=True)
            acks = llm.update_weights(pm, version)
            assert sorted(acks) == [0, 1]
            assert {a["weight_version"] for a in acks.values()} == {version}
            streamed = plan_layout(as_state_dict(pm))[1]  # the adapter's, each tensor aligned
            assert {a["bytes"] for a in acks.values()} == {streamed}
            assert len({a["checksum"] for a in acks.values()}) == 1
            assert_matches_merged(llm, pm)
    finally:
        llm.shutdown()


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_an_adapter_pushed_at_another_scale_is_served_at_the_pushed_scale():
    """Engines started with r=8, lora_alpha=16 (scale 2); the trainer's PEFT model has the same
    base and rank but lora_alpha=64 (scale 8), then use_rslora (64/sqrt(8)). The scale travels
    inside the signed update (a `lora_scale` tensor per module): the engine processes' greedy
    tokens and log-probs equal the pushed model's, never the engine's old scale (issue 31,
    defect 2). Embedded and dp=2 engine processes."""
    started = make_peft(r=8, alpha=16)
    pushed = [make_peft(r=8, alpha=64), make_peft(r=8, alpha=64, rslora=True)]
    embedded = RolloutManager(model=from_transformers(started)[0],
                              inference_config=InferenceConfig(**ICFG))  # fmt: skip
    llm = LLM(started, None, InferenceConfig(**ICFG), use_coordinator=True, data_parallel_size=2)
    try:
        for version, pm in enumerate(pushed, start=1):
            _perturb(pm, seed=version, std=0.2, lora=True)
            assert embedded.update_weights(pm) == version
            assert_matches_merged(embedded, pm)
            acks = llm.update_weights(pm, version)
            assert {a["weight_version"] for a in acks.values()} == {version}
            assert_matches_merged(llm, pm)
    finally:
        embedded.close()
        llm.shutdown()


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_snapshot_keeps_the_base_across_adapter_only_updates(tmp_path, mode):
    """A restarted engine loads the snapshot: base and adapter at their last pushed values."""
    snap = WeightSnapshot(lambda: tmp_path, mode)
    tied = torch.ones(2)
    snap.save({"w": tied, "head": tied, "x.lora_A.weight": torch.zeros(1)}, 1)
    snap.save({"x.lora_A.weight": torch.full((1,), 5.0)}, 2)
    version, sd = snap.state_dict()
    assert version == 2 and sd["x.lora_A.weight"].item() == 5
    assert sd["w"].tolist() == sd["head"].tolist() == [1, 1]
    assert snap.engine_kwargs()["weight_version"] == 2


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"target_modules": ["lm_head"]}, "lm_head"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 0}, "r must be"),
        ({"exclude_modules": ["q_proj"]}, "exclude_modules"),
        ({"lora_bias": True}, "lora_bias"),
    ],
)
def test_unsupported_adapters_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        LoraSpec.from_peft({"r": 4, "lora_alpha": 8, "target_modules": ALL, **options})


def test_bad_adapter_files_and_updates_are_refused(tmp_path):
    pm = make_peft()
    model, _ = from_transformers(pm)
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        apply_lora(model, lora_spec(model))
    save_adapter(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a/adapter_config.json").read_text())
    (tmp_path / "a/adapter_config.json").write_text(json.dumps({**cfg, "r": 2}))
    with pytest.raises(ValueError, match="mis-shaped"):
        load_adapter(_base(pm), tmp_path / "a")
    expert = {"base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="LoRA on MoE experts"):
        from_peft_names(expert)
    llm = LLM(model, None, InferenceConfig(**ICFG))
    half = dict(list(adapter_state_dict(model).items())[:3])  # a partial adapter: refused
    with pytest.raises(ValueError, match="missing tensors"):
        llm.engine.update_weights(half, 1)
    assert llm.engine.weight_version == 0


def _base(pm):
    return from_transformers(copy.deepcopy(pm).unload())[0]


def test_recipe_config_adapter_path_builds_an_unmerged_lora_model(tmp_path):
    from rollout.config import ConfigError, RunConfig, validate
    from rollout.config.builders import build_model_and_tokenizer

    pm = make_peft()
    _perturb(pm, seed=6, std=0.2, lora=True)
    copy.deepcopy(pm).unload().save_pretrained(tmp_path / "base")
    pm.save_pretrained(tmp_path / "adapter")
    run = RunConfig()
    run.model.name, run.model.path, run.model.tokenizer = "hf_dir", str(tmp_path / "base"), "byte"
    run.model.vocab_size = 101
    run.model.adapter_path = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="adapter_path"):
        validate(run)
    run.model.adapter_path = str(tmp_path / "adapter")
    model, _, _ = build_model_and_tokenizer(validate(run))
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert (model(ids) - pm(ids).logits).abs().max().item() <= TOLERANCE


@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_a_restarted_engine_serves_the_last_base_and_adapter():
    """dp=2: a base-only update, then an adapter-only one, then an engine is killed: it restarts
    from its base and adapter folders plus the snapshot (both parts at their last values)."""
    import os
    import signal

    from fake_engine import wait_for

    pm = make_peft()
    fast = {"heartbeat_s": 0.2, "engine_timeout_s": 1.0, "policy": "round_robin"}
    llm = LLM(pm, None, InferenceConfig(**ICFG), use_coordinator=True, data_parallel_size=2,
              coordinator=fast)  # fmt: skip
    cluster = llm.cluster
    try:
        _perturb(pm, seed=1, std=0.05, lora=False)
        base = {n.replace(".base_layer.", "."): t for n, t in pm.get_base_model().state_dict().items()
                if "lora_" not in n}  # fmt: skip
        llm.update_weights(base, 1)
        _perturb(pm, seed=2, std=0.2, lora=True)
        llm.update_weights(pm, 2)
        dead = cluster.engine_processes[1]
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(10)
        wait_for(lambda: cluster.supervision_stats()["restarts"] == 1, 90, "restart")
        wait_for(lambda: sorted(cluster.stats()["engines"]) == [0, 1], 90, "2 engines")
        assert {e["weight_version"] for e in cluster.stats()["engines"].values()} == {2}
        assert_matches_merged(llm, pm)  # round robin: both engines answer
    finally:
        llm.shutdown()
