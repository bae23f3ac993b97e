"""rollout.metrics: namespaced W&B logging read back from an offline run; staleness summaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout.metrics import (
    MetricsLogger,
    NullLogger,
    check_keys,
    make_logger,
    read_offline_run,
    resolve_mode,
    staleness_summary,
)


def test_offline_run_writes_namespaced_history_and_config(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = MetricsLogger(project="test", dir=tmp_path, config={"trainer": {"lr": 1e-3}})
    assert logger.mode == "offline"
    stale = staleness_summary(
        [torch.tensor([0, 0, 1]), torch.tensor([2])], kv=[torch.tensor([0, 0, 0, 1])]
    )
    for step in range(3):
        logger.log({"train/reward": 0.1 * step, "train/loss": torch.tensor(1.0 / (step + 1)),
                    "rollout/tokens_per_s": np.float32(100.0 + step), "engine/kv_usage": 0.5,
                    "weight_sync/transfer_s": 0.01, "mismatch/kl_k3": 0.0, **stale},
                   step=step)  # fmt: skip
    logger.log_config({"rollout": {"mode": "colocated"}})
    run_dir = logger.run_dir
    logger.finish()
    assert run_dir is not None and run_dir.is_relative_to(tmp_path)
    assert list(run_dir.glob("run-*.wandb"))

    run = read_offline_run(run_dir)
    assert [r["_step"] for r in run["history"]] == [0, 1, 2]
    last = run["history"][-1]
    for key in ("train/reward", "train/loss", "rollout/tokens_per_s", "engine/kv_usage",
                "weight_sync/transfer_s", "mismatch/kl_k3", "staleness/policy_mean",
                "staleness/kv_max", "staleness/policy_p99"):  # fmt: skip
        assert key in last, key
    assert last["train/reward"] == pytest.approx(0.2)
    assert last["train/loss"] == pytest.approx(1 / 3)
    assert last["staleness/policy_mean"] == pytest.approx(3 / 4)
    hist = last["staleness/policy_hist"]
    assert hist["_type"] == "histogram" and hist["values"] == [2, 1, 1]
    assert run["config"]["trainer"] == {"lr": 1e-3}
    assert run["config"]["rollout"] == {"mode": "colocated"}
    assert run["summary"]["train/reward"] == pytest.approx(0.2)
    # The same folder through the wandb/ dir (latest-run) also works.
    assert read_offline_run(tmp_path / "wandb")["history"][0]["_step"] == 0
    # The in-memory history serves reward curves.
    assert logger.series("train/reward") == ([0, 1, 2], [0.0, 0.1, 0.2])


@pytest.mark.parametrize("key", ["loss", "training/loss", "train/", "/loss", "Train/loss"])
def test_namespace_violation_raises_naming_key(key):
    logger = NullLogger()
    with pytest.raises(ValueError, match=f"metric key '{key}'"):
        logger.log({"train/ok": 1.0, key: 1.0}, step=0)
    assert logger.history == []


def test_log_rejects_bad_values_and_backwards_steps():
    logger = NullLogger()
    with pytest.raises(ValueError, match=r"train/x.*3 elements"):
        logger.log({"train/x": torch.ones(3)})
    with pytest.raises(ValueError, match="train/name"):
        logger.log({"train/name": "abc"})
    logger.log({"train/a": 1}, step=5)
    logger.log({"train/b": 2}, step=5)  # same step merges
    assert logger.history == [{"step": 5, "train/a": 1, "train/b": 2}]
    logger.log({"train/a": 3})  # no step: the next one
    assert logger.history[-1]["step"] == 6
    with pytest.raises(ValueError, match="step"):
        logger.log({"train/a": 1}, step=2)


def test_modes(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolve_mode(None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode("auto") == "online"
    assert resolve_mode("disabled") == "disabled"
    with pytest.raises(ValueError, match="'cloud'"):
        resolve_mode("cloud")
    logger = make_logger("disabled")
    assert isinstance(logger, NullLogger) and logger.run is None
    disabled = MetricsLogger(mode="disabled", config={"a": 1})
    assert disabled.run is None and disabled.run_dir is None and disabled.config == {"a": 1}
    disabled.log({"train/x": 1.0}, step=0)
    disabled.finish()


def test_log_config_resolves_dataclass_and_omegaconf():
    import dataclasses
    import enum

    from omegaconf import OmegaConf

    class Mode(enum.Enum):
        colocated = 1

    @dataclasses.dataclass
    class Cfg:
        mode: Mode = Mode.colocated
        lr: float = 0.1

    logger = NullLogger()
    assert logger.log_config(Cfg()) == {"mode": "colocated", "lr": 0.1}
    conf = OmegaConf.create({"a": 2, "b": "${a}"})
    assert logger.log_config(conf) == {"a": 2, "b": 2}
    with pytest.raises(ValueError, match="config"):
        logger.log_config([1, 2])


def test_staleness_summary_is_token_weighted():
    # Sample A: 9 fresh tokens; sample B: 1 token with staleness 10. Per-sample mean would be 5.
    s = staleness_summary([torch.zeros(9, dtype=torch.int32), torch.tensor([10])], histograms=False)
    assert s["staleness/policy_mean"] == pytest.approx(1.0)
    assert s["staleness/policy_max"] == 10.0
    assert s["staleness/policy_stale_frac"] == pytest.approx(0.1)
    assert s["staleness/tokens"] == 10.0
    assert "staleness/policy_hist" not in s and "staleness/kv_mean" not in s
    x = torch.arange(100)
    s = staleness_summary(x, kv=x // 2, histograms=False)
    assert s["staleness/policy_p99"] == pytest.approx(np.percentile(np.arange(100), 99))
    assert s["staleness/kv_max"] == 49.0
    empty = staleness_summary([], histograms=False)
    assert empty["staleness/policy_mean"] == 0.0 and empty["staleness/tokens"] == 0.0
    with pytest.raises(ValueError, match="negative"):
        staleness_summary(torch.tensor([-1]))
    check_keys(staleness_summary(x, kv=x))  # every key is in the fixed namespaces


def test_save_plot_writes_png(tmp_path):
    from rollout.metrics import save_plot

    logger = NullLogger()
    for step in range(5):
        logger.log({"train/reward": step / 4, "staleness/policy_mean": 0.5}, step=step)
    out = save_plot(
        logger,
        tmp_path / "plots" / "reward.png",
        keys=("train/reward", "staleness/policy_mean", "train/kl"),
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to plot"):
        save_plot(logger, tmp_path / "x.png", keys=("train/kl",))
