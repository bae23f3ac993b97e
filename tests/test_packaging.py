"""Packaging: a wheel built offline carries the Hydra config groups, and an install from it composes.

The configs live in the top-level `conf/`; the build maps it into the package as `rollout/conf`
(pyproject.toml), found through `rollout.config.CONF_DIR` either way, so a plain
`pip install rollout-*.whl` runs recipes without the source tree. The build runs on a copy of the
sources in a temporary directory: no `build/` or `*.egg-info` churn in the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rollout.config import CONF_DIR
from rollout.config.schema import GROUPS

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "conf", "rollout", "trainer_hooks", "recipes")
PACKAGES = ("rollout", "trainer_hooks", "recipes")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the project's wheel offline with the venv's setuptools (no build isolation)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=IGNORE)
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(
        [*cmd, "-q", "-w", str(out), str(src)], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("rollout-*.whl")
    return whl


def test_conf_dir_is_the_top_level_conf_in_a_checkout():
    assert ROOT / "conf" == CONF_DIR
    assert (CONF_DIR / "config.yaml").is_file()
    assert not (ROOT / "rollout" / "conf").exists()  # one copy of the configs


def test_wheel_ships_every_module_of_the_source_tree(wheel):
    """pyproject.toml lists the packages by name (to map conf/ in): a new package must be listed."""
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
    }
    assert sources, PACKAGES
    assert sources <= names, sorted(sources - names)


def test_wheel_ships_every_config_group(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "rollout/conf/config.yaml" in names
    for group in GROUPS:
        expected = {f"rollout/conf/{group}/{p.name}" for p in (CONF_DIR / group).glob("*.yaml")}
        assert expected, group  # every group has at least one option in the source tree
        assert expected <= names, (group, sorted(expected - names))
    assert {"recipes/grpo_reverse.py", "recipes/tasks.py", "trainer_hooks/__init__.py"} <= names


def test_installed_wheel_composes_outside_the_source_tree(wheel, tmp_path):
    """Unpacked wheel first on sys.path, cwd elsewhere: configs come from the wheel, not the repo."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import rollout, rollout.config as c;"
        "cfg = c.load_config(['rollout=async', 'trainer.tis_cap=2.0']);"
        "print(rollout.__file__); print(c.CONF_DIR); print(cfg.rollout.mode == 'async')"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, conf_dir, mode = proc.stdout.split()[-3:]
    assert module.startswith(str(site))
    assert Path(conf_dir) == site / "rollout" / "conf"
    assert mode == "True"
