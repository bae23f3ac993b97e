"""The decoder: HF parity (Llama, Llama-3 rope scaling, tied, Qwen2, sharded), paged == dense."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout.models import (
    ModelConfig,
    PagedAttentionMetadata,
    build_model,
    kv_bytes_per_block,
    kv_cache_shape,
    load_pretrained,
    save_pretrained,
)

transformers = pytest.importorskip("transformers")

HF_KW = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
HF_CASES = {
    "llama3-rope-scaling": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=100.0)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama-bias": ("llama", dict(attention_bias=True)),
    "qwen2": ("qwen2", dict(rope_theta=1e6)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
}


def make_hf(arch: str, extra: dict, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**HF_KW, **extra})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**{**HF_KW, **extra})
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # large random weights so that any mismatch shows in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def tokens(batch: int = 2, length: int = 40, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_checkpoint_parity(tmp_path, case, sharded):
    arch, extra = HF_CASES[case]
    hf = make_hf(arch, extra)
    hf.save_pretrained(tmp_path, max_shard_size="16KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    model, config = load_pretrained(tmp_path)
    assert config.architecture == arch
    assert config.tie_word_embeddings == extra.get("tie_word_embeddings", False)
    if "rope_scaling" in extra:
        assert config.rope_scaling["rope_type"] == "llama3"
    x = tokens()
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
    assert diff <= 1e-4
    if "rope_scaling" in extra:  # the scaling matters at this size: dropping it shows
        unscaled = build_model(dataclasses.replace(config, rope_scaling=None))
        unscaled.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (hf(x).logits - unscaled(x)).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", ["llama3-rope-scaling", "qwen2-tied"])
@pytest.mark.parametrize("max_shard_bytes", [None, 12_000])
def test_our_checkpoint_loads_in_hf(tmp_path, case, max_shard_bytes):
    arch, extra = HF_CASES[case]
    hf = make_hf(arch, extra)
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_pretrained(tmp_path / "hf")
    files = save_pretrained(model, config, tmp_path / "ours", max_shard_bytes=max_shard_bytes)
    assert (len(files) > 1) == (max_shard_bytes is not None)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    back = cls.from_pretrained(tmp_path / "ours").eval()
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["architectures"] == [cls.__name__]
    x = tokens()
    with torch.no_grad():
        assert (back(x).logits - model(x)).abs().max().item() <= 1e-4
    # and our own round trip is exact
    again, config2 = load_pretrained(tmp_path / "ours")
    assert config2.to_hf() == config.to_hf()
    for (n1, p1), (n2, p2) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert n1 == n2 and torch.equal(p1, p2)


def test_parameter_names_match_hf():
    hf = make_hf("qwen2", {})
    ours = build_model(ModelConfig.from_hf(hf.config.to_dict()))
    assert set(ours.state_dict()) == set(hf.state_dict())


def _rewrite_weights(path, tensors):
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _set_architecture(path, name):
    hf = json.loads((path / "config.json").read_text())
    hf["architectures"] = [name]
    (path / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (
            lambda p, w: _rewrite_weights(
                p, {k: v for k, v in w.items() if "layers.1.mlp.up_proj" not in k}
            ),
            r"missing.*layers\.1\.mlp\.up_proj",
        ),
        (
            lambda p, w: _rewrite_weights(
                p, {**w, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}
            ),
            r"unexpected.*layers\.9",
        ),
        (
            lambda p, w: _rewrite_weights(p, {**w, "model.norm.weight": torch.ones(65)}),
            r"mis-shaped.*model.norm.weight.*\(65,\).*\(64,\)",
        ),
        (lambda p, w: _set_architecture(p, "MixtralForCausalLM"), "MixtralForCausalLM"),
    ],
    ids=["missing-tensor", "unexpected-tensor", "mis-shaped-tensor", "unsupported-architecture"],
)
def test_load_errors(tmp_path, corrupt, match):
    config = ModelConfig.preset("tiny", vocab_size=64)
    save_pretrained(build_model(config, seed=0), config, tmp_path)
    corrupt(tmp_path, load_file(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path)


def test_load_from_a_missing_directory_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            {"hidden_size": 64, "num_attention_heads": 5},
            "num_attention_heads=5 does not divide hidden_size=64",
        ),
        (
            {"num_attention_heads": 4, "num_key_value_heads": 3},
            "num_key_value_heads=3 does not divide",
        ),
        ({"architecture": "gpt2"}, "architecture"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ],
    ids=[
        "heads-not-dividing-hidden",
        "kv-heads-not-dividing-heads",
        "architecture-gpt2",
        "rope-longrope",
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


def test_presets():
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.preset("huge")
    tiny = ModelConfig.preset("tiny", vocab_size=260)
    assert (tiny.vocab_size, tiny.hidden_size, tiny.num_hidden_layers) == (260, 64, 2)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (4, 2)
    model = build_model(tiny)
    assert sum(p.numel() for p in model.parameters()) == tiny.num_parameters()
    assert 15e6 <= ModelConfig.preset("small").num_parameters() <= 25e6
    assert 85e6 <= ModelConfig.preset("medium").num_parameters() <= 115e6
    assert ModelConfig.from_hf(tiny.to_hf()) == tiny
    assert kv_cache_shape(tiny, 10, 4) == (2, 2, 10, 4, 2, 16)
    assert kv_bytes_per_block(tiny, 4, torch.bfloat16) == 2 * 2 * 4 * 2 * 16 * 2


def run_paged(model, seqs, schedule, block_size, num_blocks, dtype=torch.float32, seed=0):
    """Feed `seqs` through forward_paged, step by step: schedule[s][i] = tokens of seq i in step s.

    Blocks come from a shuffled pool. Returns per step the logits and (seq, positions) rows.
    """
    config = model.config
    cache = torch.zeros(kv_cache_shape(config, num_blocks, block_size), dtype=dtype)
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables: list[list[int]] = [[] for _ in seqs]
    done = [0] * len(seqs)
    out = []
    for step in schedule:
        ids, pos, q_lens, ctx_lens, bt, rows = [], [], [], [], [], []
        for i, q in enumerate(step):
            if q == 0:
                continue
            end = done[i] + q
            while len(tables[i]) * block_size < end:
                tables[i].append(pool.pop())
            ids += seqs[i][done[i] : end].tolist()
            pos += range(done[i], end)
            q_lens.append(q)
            ctx_lens.append(end)
            bt.append(tables[i])
            rows.append((i, done[i], end))
            done[i] = end
        meta = PagedAttentionMetadata.from_lists(q_lens, ctx_lens, bt, block_size)
        with torch.no_grad():
            hidden = model.forward_paged(torch.tensor(ids), torch.tensor(pos), meta, cache)
            out.append((model.compute_logits(hidden), rows))
    return out


MOE_TINY = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
EXTRA = {"qwen3_moe": MOE_TINY, "qwen2_moe": dict(MOE_TINY, shared_expert_intermediate_size=48,
                                                  decoder_sparse_step=2)}  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "kv_heads"),
    [("llama", 2), ("llama", 4), ("qwen2", 1), ("qwen3", 2), ("qwen3_moe", 2), ("qwen2_moe", 1)],
)
def test_forward_paged_matches_forward(arch, kv_heads):
    config = ModelConfig.preset("tiny", vocab_size=128, architecture=arch,
                                num_key_value_heads=kv_heads, **EXTRA.get(arch, {}))  # fmt: skip
    model = build_model(config, seed=0).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # non-trivial norms and biases
    prompts = [1, 6, 9, 14, 3]
    decode_steps = 6
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 128, (n + decode_steps,), generator=gen) for n in prompts]
    schedule = [
        [1, 4, 9, 5, 0],  # seq 0 starts decoding at once; seq 4 waits
        [1, 2, 0, 5, 3],  # chunks of different sizes next to decodes
        [1, 0, 1, 4, 1],
        *[[1, 1, 1, 1, 1]] * 4,  # pure decode batches
        [0, 1, 1, 1, 0],
    ]
    schedule.append([decode_steps + p - sum(s[i] for s in schedule) for i, p in enumerate(prompts)])
    assert all(q >= 0 for q in schedule[-1])
    steps = run_paged(model, seqs, schedule, block_size=4, num_blocks=64)
    checked = 0
    with torch.no_grad():
        for logits, rows in steps:
            offset = 0
            for i, start, end in rows:
                ref = model(seqs[i][:end][None])[0, start:end]
                got = logits[offset : offset + end - start]
                assert (ref - got).abs().max().item() <= 1e-5, (i, start, end)
                offset += end - start
                checked += end - start
    assert checked == sum(len(s) for s in seqs)


def test_forward_paged_bf16_close():
    config = ModelConfig.preset("tiny", vocab_size=64)
    model = build_model(config, seed=0, dtype=torch.bfloat16).eval()
    seqs = [torch.randint(0, 64, (12,)), torch.randint(0, 64, (7,))]
    steps = run_paged(model, seqs, [[8, 5], [4, 2]], 4, 16, dtype=torch.bfloat16)
    logits, _ = steps[-1]
    assert logits.dtype == torch.bfloat16
    with torch.no_grad():
        ref = model(seqs[0][None])[0, 8:12].float()
    assert (ref - logits[:4].float()).abs().max().item() < 0.05


def test_paged_metadata_validation():
    config = ModelConfig.preset("tiny", vocab_size=64)
    model = build_model(config, seed=0)
    cache = torch.zeros(kv_cache_shape(config, 8, 4))
    with pytest.raises(ValueError, match="query_len <= context_len"):
        PagedAttentionMetadata.from_lists([3], [2], [[0]], 4)
    with pytest.raises(ValueError, match="cannot hold"):
        PagedAttentionMetadata.from_lists([1], [9], [[0, 1]], 4)
    meta = PagedAttentionMetadata.from_lists([2], [2], [[5]], 4)
    assert meta.slot_mapping.tolist() == [20, 21]
    with pytest.raises(ValueError, match="tokens"):
        model.forward_paged(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), meta, cache)
    with pytest.raises(ValueError, match="kv_cache"):
        model.forward_paged(torch.tensor([1, 2]), torch.tensor([0, 1]), meta, cache[:, :1])


def test_forward_paged_bucketed_decodes():
    """Many decodes of very different context lengths: several SDPA buckets, rows out of order."""
    from rollout.models.attention import AttentionPlan

    config = ModelConfig.preset("tiny", vocab_size=64)
    model = build_model(config, seed=1).eval()
    prompts = [2, 40, 5, 23, 9, 31, 3, 17, 12, 36, 7, 28]
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 64, (n + 3,), generator=gen) for n in prompts]
    mixed = [1] * len(prompts)
    mixed[4] = 0
    schedule = [prompts, [1] * len(prompts), mixed, [1 if q else 2 for q in mixed]]
    steps = run_paged(model, seqs, schedule, block_size=4, num_blocks=256, seed=2)
    plan = AttentionPlan(
        PagedAttentionMetadata.from_lists([1] * 12, [p + 1 for p in prompts], [[0] * 11] * 12, 4),
        block_size=4,
        num_tokens=12,
    )
    assert len(plan.decode_groups) > 1
    with torch.no_grad():
        for logits, rows in steps:
            offset = 0
            for i, start, end in rows:
                ref = model(seqs[i][:end][None])[0, start:end]
                assert (ref - logits[offset : offset + end - start]).abs().max().item() <= 1e-5
                offset += end - start


def test_dtype_on_load_and_training_grads(tmp_path):
    config = ModelConfig.preset("tiny", vocab_size=64, tie_word_embeddings=False)
    model = build_model(config, seed=0, dtype=torch.bfloat16)
    save_pretrained(model, config, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    same, _ = load_pretrained(tmp_path)  # dtype=None keeps the saved dtype
    assert same.dtype == torch.bfloat16
    f32, _ = load_pretrained(tmp_path, dtype=torch.float32)
    assert f32.dtype == torch.float32 and not f32.training
    assert torch.equal(f32.lm_head.weight, model.lm_head.weight.float())
    # the dense path is what trainers differentiate
    f32.train()
    x = tokens(2, 9, vocab=64)
    loss = torch.nn.functional.cross_entropy(f32(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in f32.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_forward_paged_zero_copy_and_shared_prefix_paths(arch):
    """Contiguous tables (slices of the pool), scattered ones (gathered) and decode rows that
    share prompt blocks (cascade) in the same batches all match the dense forward."""
    from rollout.models.attention import AttentionPlan

    config = ModelConfig.preset("tiny", vocab_size=64, architecture=arch, **EXTRA.get(arch, {}))
    model = build_model(config, seed=2).eval()
    bs = 4
    gen = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(0, 64, (n,), generator=gen).tolist()

    prompt = rand(40)
    seqs = {f"s{i}": prompt + rand(6) for i in range(3)}  # samples sharing the prompt's blocks
    seqs.update(p=prompt, long=rand(47), short=rand(14))
    tables = {
        "p": list(range(10)),
        "s0": list(range(12)),  # contiguous with the prompt: one slice
        "s1": [*range(10), 30, 25],  # own blocks elsewhere: gathered
        "s2": [*range(10), 12, 13],
        "long": list(range(40, 52)),
        "short": [60, 58, 56, 54],
    }
    cache = torch.zeros(kv_cache_shape(config, 64, bs))

    def step(items):  # (name, start, end)
        ids, pos = [], []
        for name, start, end in items:
            ids += seqs[name][start:end]
            pos += range(start, end)
        meta = PagedAttentionMetadata.from_lists(
            [e - s for _, s, e in items], [e for _, _, e in items],
            [tables[n] for n, _, _ in items], bs,
        )  # fmt: skip
        with torch.no_grad():
            logits = model.compute_logits(
                model.forward_paged(torch.tensor(ids), torch.tensor(pos), meta, cache)
            )
            row = 0
            for name, start, end in items:
                ref = model(torch.tensor([seqs[name][:end]]))[0, start:end]
                assert (ref - logits[row : row + end - start]).abs().max().item() <= 1e-5, name
                row += end - start
        return AttentionPlan(meta, bs, len(ids))

    step([("p", 0, 40), ("long", 0, 43), ("short", 0, 10)])
    plan = step([("s0", 40, 43), ("s1", 40, 43), ("s2", 40, 43), ("long", 43, 44),
                 ("short", 10, 11)])  # fmt: skip
    firsts = [p.first for p in plan.prefills]
    assert firsts == [0, None, None] and len(plan.decode_views) == 1  # s0 slice, s1/s2 gather
    for t in range(3):
        plan = step([(f"s{i}", 43 + t, 44 + t) for i in range(3)]
                    + [("long", 44 + t, 45 + t), ("short", 11 + t, 12 + t)])  # fmt: skip
        assert [b.num_rows for b in plan.shared_batches] == [3]
        assert len(plan.decode_views) == 1 and len(plan.decode_groups) == 1  # long / short


def test_decode_views_and_packed_linears_follow_weight_changes():
    """Pure decode steps of contiguous rows (every row a zero-copy view) at a steady batch size
    run through the MKL-packed weights on CPU; an in-place weight change re-packs, and a deep
    copy starts without packs. Every step matches the dense forward."""
    import copy

    from rollout.models import packed
    from rollout.models.attention import AttentionPlan

    config = ModelConfig.preset("tiny", vocab_size=64)
    model = build_model(config, seed=4).eval()
    bs, lens, steps = 4, [33, 40, 50], packed.STABLE + 2
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, 64, (n + steps,), generator=gen).tolist() for n in lens]
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(3)]  # one run each

    def generate(m):
        cache = torch.zeros(kv_cache_shape(config, 64, bs))
        for i, n in enumerate(lens):  # prefill each alone
            meta = PagedAttentionMetadata.from_lists([n], [n], [tables[i]], bs)
            with torch.no_grad():
                m.forward_paged(torch.tensor(seqs[i][:n]), torch.arange(n), meta, cache)
        for t in range(steps):
            ctx = [n + t + 1 for n in lens]
            meta = PagedAttentionMetadata.from_lists([1] * 3, ctx, tables, bs)
            ids = torch.tensor([s[c - 1] for s, c in zip(seqs, ctx, strict=True)])
            with torch.no_grad():
                got = m.compute_logits(m.forward_paged(ids, torch.tensor(ctx) - 1, meta, cache))
                for i, c in enumerate(ctx):
                    ref = m(torch.tensor([seqs[i][:c]]))[0, -1]
                    assert (ref - got[i]).abs().max().item() <= 1e-5, (t, i)
        assert AttentionPlan(meta, bs, 3).views_are_all_rows

    generate(model)
    if packed._OPS is not None:
        assert model.packed.rows == 3 and model.packed._packs
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)  # in place: the packs must notice
    generate(model)
    twin = copy.deepcopy(model)
    assert twin.packed.rows == 0 and not twin.packed._packs
    generate(twin)
