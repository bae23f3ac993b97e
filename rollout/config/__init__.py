"""Hydra structured configs for a whole RL run, and the cross-field checks that guard them.

One dataclass per config group (`model`, `engine`, `coordinator`, `rollout`, `trainer`,
`logger`, `recipe`) composed into `RunConfig`, registered in Hydra's ConfigStore as
`base_config`; `conf/config.yaml` starts from it, so every YAML option and every command-line
override is type-checked by OmegaConf (a wrong type or an unknown enum value fails with the key
and the allowed values). `validate()` adds what types cannot express: relations between groups
(async rollouts need importance correction, the KV pool must hold one max-length request, GRPO
needs a group, ...). It reports every problem at once, each naming the key and what is allowed.

    from rollout.config import load_config
    cfg = load_config(["rollout=async", "trainer.tis_cap=2.0"])    # composed + validated

Hydra apps: `@hydra.main(config_path=str(CONF_DIR), config_name="config")`, then
`cfg = validate(dict_cfg)` first thing in the task function.

Modules: `schema` (the dataclasses and enums), `checks` (`to_run_config`, `validate`), `builders`
(objects for the app from a RunConfig: engine and manager configs, the manager, the logger); this
module composes and loads, and exports only that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException

from rollout.config.checks import validate
from rollout.config.schema import ConfigError, RunConfig


def _conf_dir() -> Path:
    """The Hydra config groups: `rollout/conf` in an installed wheel (the build maps the top-level
    `conf/` there, see pyproject.toml), the repository's `conf/` in a source checkout."""
    package = Path(__file__).resolve().parent.parent
    packaged = package / "conf"
    return packaged if packaged.is_dir() else package.parent / "conf"


CONF_DIR = _conf_dir()


def compose(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> Any:
    """Compose `conf/<config_name>.yaml` with overrides (outside a Hydra app) -> DictConfig."""
    try:
        if GlobalHydra.instance().is_initialized():
            return hydra_compose(config_name=config_name, overrides=list(overrides))
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except HydraException as e:  # "Error merging override x=y" + OmegaConf's reason (the cause)
        cause = f"\n{e.__cause__}" if e.__cause__ is not None else ""
        raise ConfigError(f"{e}{cause}") from e


def load_config(
    overrides: list[str] | tuple[str, ...] = (), config_name: str = "config"
) -> RunConfig:
    """compose + validate: the RunConfig a program can use, or ConfigError / Hydra's error."""
    return validate(compose(overrides, config_name))


__all__ = ["CONF_DIR", "ConfigError", "compose", "load_config", "validate"]
