"""rollout.config + conf/: every group option composes and validates; bad overrides fail clearly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from rollout.config import CONF_DIR, ConfigError, compose, load_config, validate
from rollout.config.builders import (
    build_logger,
    build_model_and_tokenizer,
    inference_config,
    kv_bytes_per_block,
    manager_config,
    model_config,
    sampling_params,
    to_dict,
)
from rollout.config.schema import GROUPS, KVPolicy, RolloutCfg, RolloutMode, RunConfig


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from rollout.models import ModelConfig, build_model, save_pretrained
    from rollout.tokenizers import ByteTokenizer

    d = tmp_path_factory.mktemp("ckpt")
    mc = ModelConfig.preset("tiny", vocab_size=300)
    save_pretrained(build_model(mc, seed=1), mc, d)
    ByteTokenizer().save(d)
    return d


def _options():
    for group in GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            yield group, path.stem


# What each option needs besides itself to make a valid run (cross-field checks).
_EXTRA = {
    ("rollout", "async"): ["trainer.tis_cap=2.0"],
    # engine=gpu asks for CUDA, a config error without it (tests/readme/test_readme_growing.py).
    ("engine", "gpu"): [] if torch.cuda.is_available() else ["model.device=cpu"],
}


def test_every_group_has_options():
    found = {g for g, _ in _options()}
    assert found == set(GROUPS)
    assert {o for g, o in _options() if g == "recipe"} >= {"grpo_reverse", "grpo_reverse_async"}


@pytest.mark.parametrize(("group", "option"), list(_options()))
def test_compose_and_validate_every_option(group, option, hf_dir):
    overrides = [f"{group}={option}", *_EXTRA.get((group, option), [])]
    if (group, option) == ("model", "hf_dir"):
        overrides.append(f"model.path={hf_dir}")
    run = load_config(overrides)
    assert isinstance(run, RunConfig)
    if group == "model":
        assert run.model.name == option
    elif group == "rollout":
        assert run.rollout.mode == option
    elif group == "logger":
        assert run.logger.mode == option
    elif group == "recipe":
        assert run.recipe.name == option
    elif group == "trainer":
        assert run.trainer.loss == option


def test_defaults_are_the_embedded_cpu_run():
    run = load_config()
    assert (run.model.name, run.model.device, run.rollout.mode, run.rollout.dp) == (
        "tiny",
        "cpu",
        "colocated",
        1,
    )
    assert run.logger.mode == "offline" and run.recipe.task == "reverse"
    assert run.rollout.mode is RolloutMode.colocated  # a real Enum, comparable to its string


def test_async_recipe_switches_mode_and_turns_on_tis():
    run = load_config(["recipe=grpo_reverse_async"])
    assert run.rollout.mode == "async" and run.trainer.tis_cap == 2.0
    assert run.recipe.name == "grpo_reverse_async"
    # Command-line choices still win over the recipe's.
    assert (
        load_config(["recipe=grpo_reverse_async", "rollout=colocated"]).rollout.mode == "colocated"
    )


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["rollout.mode=sideways"], ["rollout.mode", "expected one of [colocated, async]"]),
        (["trainer.lr=fast"], ["trainer.lr", "could not be converted to Float"]),
        (["engine.block_size=1.5"], ["engine.block_size"]),
        (["rollout.no_such_key=1"], ["rollout.no_such_key"]),
        (["model=giant"], ["model/giant", "tiny"]),
        (["coordinator.policy=random"], ["coordinator.policy", "longest_prefix"]),
        (["engine.suspend_mode=sleep"], ["engine.suspend_mode", "persist, offload, recompute"]),
        (["logger.mode=cloud"], ["logger.mode", "offline, online, disabled"]),
    ],
)
def test_hydra_type_errors_name_the_key(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["rollout=async", "trainer.tis_cap=null"], ["rollout.mode=async", "trainer.tis_cap"]),
        (["engine.num_blocks=1", "rollout.max_new_tokens=64"],
         ["KV pool too small", "engine.num_blocks=1", "< 65 (prompt 1 + rollout.max_new_tokens 64)"]),
        (["engine.kv_cache_memory_bytes=4096"], ["KV pool too small", "engine.kv_cache_memory_bytes=4096", "8192 bytes per block"]),
        (["rollout.max_new_tokens=300"], ["engine.max_sequence_length=256", "rollout.max_new_tokens=300"]),
        (["rollout.dp=0"], ["rollout.dp must be >= 1, got 0"]),
        (["rollout.samples_per_prompt=0"], ["rollout.samples_per_prompt must be >= 1"]),
        (["rollout.samples_per_prompt=1"], ["trainer.loss=grpo", "samples_per_prompt >= 2"]),
        (["rollout.kv_policy=keep"], ["rollout.kv_policy=keep", "engine.suspend_mode=offload"]),
        (["trainer.tis_cap=0.5"], ["trainer.tis_cap must be >= 1"]),
        (["trainer.min_lr_ratio=1.5"], ["trainer.min_lr_ratio must be in [0, 1]"]),
        (["rollout.top_p=0"], ["rollout.top_p must be in (0, 1]"]),
        (["trainer.betas=[0.9,1.5]"], ["trainer.betas"]),
        (["coordinator.engine_timeout_s=0.5"], ["coordinator.engine_timeout_s", "heartbeat_s"]),
        (["coordinator.port=70000"], ["coordinator.port"]),
        (["coordinator.max_restarts=-1"], ["coordinator.max_restarts must be >= 0"]),
        (["coordinator.restart_backoff_s=60"], ["coordinator.restart_backoff_s (60.0)"]),
        (["coordinator.token=a", "coordinator.token_file=/f"], ["token_file are both set"]),
        (["coordinator.weights_snapshot=gpu"], ["coordinator.weights_snapshot", "memory"]),
        (["model.name=huge"], ["model.name='huge'", "tiny"]),
        (["model=hf_dir"], ["model.path must be set"]),
        (["model.device=gpu0"], ["model.device='gpu0'"]),
        (["engine.enable_chunked_prefill=false", "engine.max_tokens_per_step=128"],
         ["engine.enable_chunked_prefill=true"]),
    ],
)  # fmt: skip
def test_cross_field_checks(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(["rollout.dp=0", "trainer.lr=-1", "rollout=async", "trainer.tis_cap=null"])
    msg = str(info.value)
    assert "rollout.dp" in msg and "trainer.lr" in msg and "trainer.tis_cap" in msg


def test_fixing_the_reported_key_makes_it_valid():
    assert load_config(["rollout=async", "trainer.tis_cap=2.0"]).rollout.mode == "async"
    ok = load_config(["rollout.kv_policy=keep", "engine.suspend_mode=offload"])
    assert ok.rollout.kv_policy is KVPolicy.keep
    assert load_config(["engine.num_blocks=5", "rollout.max_new_tokens=64"]).engine.num_blocks == 5


def test_validate_accepts_dataclass_and_dict_and_round_trips():
    run = validate(RunConfig(rollout=RolloutCfg(samples_per_prompt=4)))
    assert run.rollout.samples_per_prompt == 4
    assert validate(to_dict(run)) == run
    with pytest.raises(ConfigError, match=r"rollout\.mode"):
        validate({"rollout": {"mode": "nope"}})
    with pytest.raises(ConfigError, match="RunConfig"):
        validate([1, 2])


def test_builders(hf_dir):
    run = load_config(["model.dtype=bfloat16"])
    ic = inference_config(run)
    assert (ic.block_size, ic.kv_policy, ic.dtype, ic.device) == (
        16,
        "recompute",
        "bfloat16",
        "cpu",
    )
    assert ic.batch_invariant is False
    assert inference_config(load_config(["engine.batch_invariant=true"])).batch_invariant is True
    sp = sampling_params(run, stop_token_ids=[257])
    assert sp.num_tokens_to_generate == run.rollout.max_new_tokens and sp.return_log_probs
    assert sp.stop_token_ids == [257]
    mc = model_config(run, vocab_size=259)
    assert mc.vocab_size == 259 and mc.hidden_size == 64
    # K and V, 2 layers, 16 positions, 2 KV heads of 16 dims, 2 bytes each.
    assert kv_bytes_per_block(run) == 2 * 2 * 16 * 2 * 16 * 2
    mgr = manager_config(load_config(["recipe=grpo_reverse_async"]))
    assert (mgr.mode, mgr.max_staleness, mgr.stale_policy, mgr.suspend_mode) == (
        "async",
        2,
        "drop",
        "recompute",
    )
    assert mgr.max_inflight_groups is None  # partial rollouts: the manager keeps extra groups going
    sync = manager_config(
        load_config(["rollout.partial_rollouts=false", "rollout.prompts_per_step=4"])
    )
    assert sync.max_inflight_groups == 4
    hf = load_config(["model=hf_dir", f"model.path={hf_dir}", "model.device=cpu"])
    assert model_config(hf).vocab_size == 300
    model, tok, mc = build_model_and_tokenizer(hf)
    assert mc.vocab_size == 300 and tok.eos_id == 257 and model.training
    assert next(model.parameters()).dtype == torch.bfloat16  # hf_dir.yaml: dtype bfloat16
    model, tok, mc = build_model_and_tokenizer(run)
    assert mc.vocab_size == tok.vocab_size == 259
    again, _, _ = build_model_and_tokenizer(run)  # seeded from recipe.seed: same init
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )


def test_compose_returns_dictconfig_with_all_groups():
    cfg = compose(["model=small"])
    assert set(cfg.keys()) == set(GROUPS) and cfg.model.name == "small"


def test_hydra_app_multirun_fails_fast_on_a_bad_job(tmp_path):
    """A real @hydra.main app under -m: the good job runs, the bad one exits naming the key."""
    app = tmp_path / "app.py"
    app.write_text(
        textwrap.dedent("""
        import hydra
        from rollout.config import CONF_DIR, validate

        @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
        def main(cfg):
            run = validate(cfg)
            print("MODE", run.rollout.mode.value, run.trainer.tis_cap, flush=True)

        main()
    """)
    )
    # the recipe's default tis_cap is 2.0; switch it off so async is the invalid combination
    cmd = [sys.executable, str(app), "-m", "rollout=colocated,async", "trainer.tis_cap=null",
           f"hydra.sweep.dir={tmp_path}/out",
           "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "MODE colocated None" in out.stdout, out.stderr
    assert out.returncode != 0 and "trainer.tis_cap" in out.stderr


def test_build_logger_logs_the_resolved_config(tmp_path):
    from rollout.metrics import NullLogger, read_offline_run

    null = build_logger(load_config(["logger=disabled"]))
    assert type(null) is NullLogger and null.config["rollout"]["mode"] == "colocated"
    logger = build_logger(load_config([f"logger.dir={tmp_path}", "recipe=grpo_reverse_async"]))
    logger.log({"train/reward": 0.5}, step=0)
    logger.finish()
    run = read_offline_run(tmp_path / "wandb")
    assert (
        run["config"]["rollout"]["mode"] == "async" and run["config"]["trainer"]["tis_cap"] == 2.0
    )
    assert run["history"][0]["train/reward"] == 0.5


def test_hydra_rejects_an_unknown_lr_schedule():
    with pytest.raises(ConfigError, match="lr_schedule"):
        load_config(["trainer.lr_schedule=linear"])
