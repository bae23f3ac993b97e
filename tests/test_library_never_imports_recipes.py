"""The library never imports the applications built on it (recipes/), not even to validate a
run whose config names a recipe's task module."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib, pkgutil, sys
import rollout
OPTIONAL = {"ray", "verl"}  # extras: their modules import them at the top; absent here, skipped
for m in pkgutil.walk_packages(rollout.__path__, "rollout.", onerror=lambda name: None):
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
print(sorted(n for n in sys.modules if n == "recipes" or n.startswith("recipes.")))
from rollout.config import compose, validate
validate(compose([]))  # the default run: conf/ names recipes.tasks as its task module
print(sorted(n for n in sys.modules if n == "recipes" or n.startswith("recipes.")))
"""


def test_no_library_module_imports_recipes():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    after_import, after_validate = out.stdout.strip().splitlines()
    assert after_import == "[]", after_import
    assert after_validate == "[]", after_validate  # the task is checked by recipes.config
