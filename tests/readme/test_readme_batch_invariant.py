"""README: "Batch-invariant mode": the served flag, the python blocks (engine, trainer, replay) and
the recipe override."""

from __future__ import annotations

import asyncio

import pytest
import torch
from readme_helpers import (
    Proc,
    argv_of,
    exec_snippet,
    peer_token,
    readme_command,
    run_recipe,
    train_rows,
)

from rollout.engine.config import InferenceConfig
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient


@pytest.mark.timeout(300)
def test_serve_batch_invariant():
    """`rollout serve --model tiny --batch-invariant`: a prompt's log-probs are the same bits
    alone and inside a crowd of other prompts on the served engine."""
    argv, env = argv_of(readme_command("test_serve_batch_invariant"), DIR="tiny")
    with Proc(argv, env) as serve:
        address = serve.read_until(r"coordinator (tcp://\S+) pid")[1]
        serve.read_until(r"^ready: 1 engine")
        token = peer_token(serve, argv, env)

        async def needle() -> tuple[list[float], list[float]]:
            client = await InferenceClient(address, auth_token=token).start()
            try:
                sp = SamplingParams(temperature=0.0, num_tokens_to_generate=5,
                                    return_log_probs=True, ignore_eos=True)  # fmt: skip
                prompt = [3, 1, 4, 1, 5, 9, 2]
                alone = (await client.add_request(prompt, sp)).merge()
                crowd = [[i + 7] * (3 + 5 * i) for i in range(6)]
                crowd.insert(4, prompt)
                recs = await asyncio.gather(*[client.add_request(p, sp) for p in crowd])
                return alone.generated_log_probs, recs[4].merge().generated_log_probs
            finally:
                client.stop()

        alone, in_crowd = asyncio.run(needle())
        assert len(alone) == 5 and alone == in_crowd


def test_batch_invariant_snippet():
    """The batch-invariant block as written: its own assert is the check; the dense forward
    of the same model then scores the generated tokens with the same bits."""
    from rollout.models import batch_invariant as bi

    ns = exec_snippet("### Batch-invariant mode", {})
    alone = ns["alone"]
    tokens = torch.tensor([[1, 2, 3, *alone.generated_tokens]])
    with torch.no_grad():
        logits = ns["model"](tokens)  # the engine set model.batch_invariant
    lp = bi.token_log_probs(logits[0, 2:-1], tokens[0, 3:])
    assert torch.equal(lp, torch.tensor(alone.generated_log_probs, dtype=torch.float32))


@pytest.mark.timeout(120)
def test_batch_invariant_trainer_snippet():
    """The trainer block on a tiny Qwen3: samples from a batch-invariant manager."""
    transformers = pytest.importorskip("transformers")
    from rollout import InferenceConfig
    from rollout.models import from_transformers
    from rollout.rl.manager import RolloutManager
    from rollout.rl.manager_config import RolloutManagerConfig
    from rollout.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    cfg = transformers.Qwen3Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)  # fmt: skip
    hf_model = transformers.Qwen3ForCausalLM(cfg)
    model, _ = from_transformers(hf_model)
    sp = SamplingParams(num_tokens_to_generate=4, temperature=0.7)
    icfg = InferenceConfig(batch_invariant=True)
    with RolloutManager(RolloutManagerConfig(logprobs_mode="processed"), model=model,
                        tokenizer=tok, inference_config=icfg) as m:  # fmt: skip
        samples = m.generate(["ab", "cde"], n=2, sampling_params=sp)
    ns = exec_snippet("#### In the trainer", dict(samples=samples, hf_model=hf_model, t=0.7))
    assert ns["new_logp"].requires_grad


@pytest.mark.timeout(120)
def test_replay_snippet():
    """The replay block: a sample that spans versions 0 and 1 of a manager in batch-invariant
    mode replays exactly, and its trace scores to its own log-probs."""
    from rollout.models import ModelConfig, build_model
    from rollout.rl.manager import RolloutManager

    cfg = ModelConfig.preset("tiny", vocab_size=128)
    model = build_model(cfg, seed=0)
    weights_v0 = {k: v.clone() for k, v in model.state_dict().items()}
    weights_v1 = build_model(cfg, seed=1).state_dict()
    inference_config = InferenceConfig(num_blocks=64, block_size=8, batch_invariant=True)
    sp = SamplingParams(num_tokens_to_generate=12, ignore_eos=True)
    prompts = [{"prompt": [5, 6, 7], "sampling_params": sp.replace(num_tokens_to_generate=n)}
               for n in (2, 12)]  # fmt: skip
    with RolloutManager(model=model, inference_config=inference_config, max_inflight_groups=2,
                        suspend_mode="offload") as m:  # fmt: skip
        source = iter(prompts)
        m.collect(source, 1, n=1)
        m.suspend()
        m.update_weights(weights_v1)
        m.resume()
        (sample,) = m.collect(source, 1, n=1)
    assert sample.weight_versions == [0, 1]
    tokens = sample.completion_tokens[: sample.token_versions.count(0)]
    ns = exec_snippet("#### Replaying a rollout bit for bit", dict(
        sample=sample, model=model, tokenizer=None, weights_v0=weights_v0, weights_v1=weights_v1,
        inference_config=inference_config, tokens=tokens))  # fmt: skip
    assert ns["r"].tokens == sample.completion_tokens
    assert ns["lp"] == sample.logprobs[: len(tokens)]


@pytest.mark.timeout(300)
def test_batch_invariant_recipe(tmp_path):
    saved = run_recipe(readme_command("test_batch_invariant_recipe"), tmp_path / "run")
    rows = train_rows(saved)
    assert len(rows) == 2 and all(r["mismatch/logprob_abs_diff_max"] == 0.0 for r in rows)


@pytest.mark.heavy  # two recipe processes: over 10 s
@pytest.mark.timeout(300)
def test_seeded_rerun(tmp_path):
    """Run twice as written: every logged value but the clocks is the same."""
    from test_recipes import without_clocks

    command = readme_command("test_seeded_rerun")
    runs = [run_recipe(command, tmp_path / d) for d in ("a", "b")]
    a, b = (without_clocks(saved["history"]) for saved in runs)
    assert len(train_rows(runs[0])) == 2 and a == b
