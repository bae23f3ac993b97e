"""The library never imports the applications built on it (recipes/)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import importlib, pkgutil, sys
import rollout
for m in pkgutil.walk_packages(rollout.__path__, "rollout."):
    importlib.import_module(m.name)
print(sorted(n for n in sys.modules if n == "recipes" or n.startswith("recipes.")))
from rollout import config as C
C.validate(C.compose([]))  # composing and validating the default run: task checks included
print(sorted(n for n in sys.modules if n == "recipes" or n.startswith("recipes.")))
"""


def test_no_library_module_imports_recipes():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    after_import, after_validate = out.stdout.strip().splitlines()
    assert after_import == "[]", after_import
    # validating the default run loads the task module only because conf/ names it
    assert after_validate == "['recipes', 'recipes.tasks']", after_validate
