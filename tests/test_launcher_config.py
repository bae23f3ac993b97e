"""rollout.launcher / `rollout serve --launcher` / cluster_options={"launcher": ...}: what is
accepted and what is refused, before anything starts. Ray is the optional extra `ray`: asking
for it without Ray is refused at validation, naming what to install (Ray hidden here whether or
not it is installed). The launcher itself runs in tests/test_ray_launcher.py (heavy)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from rollout.config import compose
from rollout.config.builders import launcher_options
from rollout.config.checks import to_run_config, validate
from rollout.config.schema import ConfigError
from rollout.rl.manager import RolloutManager
from rollout.serving.cluster import EngineCluster
from rollout.serving.launcher import check_ray_options, make_launcher


@pytest.fixture
def no_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, find_spec says absent


def test_launcher_defaults_to_local_and_composes_ray_overrides():
    assert compose().rollout.launcher == "local"
    cfg = to_run_config(compose(["rollout.launcher=ray", "rollout.dp=2", "rollout.ray.placement_strategy=SPREAD",
                   "rollout.ray.cpus_per_engine=2", "rollout.ray.address=auto"]))  # fmt: skip
    opts = launcher_options(cfg)
    assert opts == {"launcher": "ray", "ray": {
        "address": "auto", "namespace": None, "placement_strategy": "SPREAD",
        "cpus_per_engine": 2.0, "gpus_per_engine": 0, "object_store_memory": None,
        "placement_timeout_s": 300.0}}  # fmt: skip
    assert launcher_options(to_run_config(compose())) == {}


def test_unknown_launcher_and_strategy_are_refused_by_key():
    with pytest.raises(ConfigError, match="launcher"):
        validate({"rollout": {"launcher": "k8s"}})
    with pytest.raises(ConfigError, match="placement_strategy"):
        validate({"rollout": {"launcher": "ray", "ray": {"placement_strategy": "RANDOM"}}})


def test_launcher_ray_without_ray_fails_validation_saying_what_to_install(no_ray):
    with pytest.raises(ConfigError) as e:
        validate({"rollout": {"launcher": "ray", "dp": 2}})
    assert "rollout.launcher=ray" in str(e.value)
    assert "pip install rollout[ray]" in str(e.value)
    validate({"rollout": {"launcher": "local", "dp": 2}})  # local needs nothing


def test_launcher_ray_and_coordinator_address_exclude_each_other():
    with pytest.raises(ConfigError, match="coordinator_address"):
        validate({"rollout": {"launcher": "ray", "coordinator_address": "tcp://h:1"}})
    with pytest.raises(ConfigError, match="cpus_per_engine"):
        validate({"rollout": {"launcher": "ray", "ray": {"cpus_per_engine": -1}}})


def test_cluster_and_manager_refuse_ray_when_absent(no_ray):
    with pytest.raises(ValueError, match=r"pip install rollout\[ray\]"):
        EngineCluster(2, "tiny", launcher="ray")
    with pytest.raises(ValueError, match=r"pip install rollout\[ray\]"):
        RolloutManager(model="tiny", cluster_options={"launcher": "ray"})
    with pytest.raises(ValueError, match="launcher must be one of"):
        EngineCluster(2, "tiny", launcher="k8s")
    with pytest.raises(ValueError, match="attach"):
        EngineCluster(2, None, launcher="ray", attach="tcp://127.0.0.1:1")


def test_ray_options_are_checked_by_name():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['gpus'\]"):
        check_ray_options({"gpus": 1})
    with pytest.raises(ValueError, match="placement_strategy"):
        check_ray_options({"placement_strategy": "pack"})
    with pytest.raises(ValueError, match="ray options apply only"):
        make_launcher("local", 2, {"address": "auto"})


def test_serve_launcher_ray_without_ray_exits_saying_what_to_install(no_ray, capsys):
    from rollout.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "tiny", "--dp", "2", "--launcher", "ray"])
    assert "pip install rollout[ray]" in str(e.value.code)


def test_ray_is_an_optional_pinned_extra_never_core():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    core = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "ray" not in core
    (pin,) = re.findall(r'^ray = \["(ray[^"]*)"\]$', text, re.M)
    assert ">=" in pin and "<" in pin, pin


def test_serve_ray_flags_without_launcher_ray_are_refused_by_name():
    from rollout.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "tiny", "--placement-strategy", "SPREAD"])
    assert "--placement-strategy apply only with --launcher ray" in str(e.value.code)
