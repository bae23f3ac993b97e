"""README: "On a Ray cluster": the main job and `rollout serve` with the ray launcher."""

from __future__ import annotations

import asyncio

import pytest
from readme_helpers import (
    Proc,
    argv_of,
    peer_token,
    readme_command,
    run_recipe,
    serve_requests,
    train_rows,
)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_ray_launcher_recipe(tmp_path, monkeypatch):
    """The main job with its engines as actors on a local Ray (the `ray` extra)."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a throwaway local Ray
    saved = run_recipe(readme_command("test_ray_launcher_recipe"), tmp_path / "run",
                       "rollout.ray.object_store_memory=100000000")  # fmt: skip
    rows = train_rows(saved)
    assert len(rows) == 2 and saved["summary"]["final_version"] == 2
    assert all(r["engine/num_engines"] == 2 for r in rows)


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_serve_launcher_ray(monkeypatch):
    """`rollout serve --launcher ray` (DIR -> tiny): a coordinator and 2 engine actors."""
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    argv, env = argv_of(readme_command("test_serve_launcher_ray"), DIR="tiny")
    with Proc(argv, env) as serve:
        address = serve.read_until(r"coordinator (tcp://\S+) pid")[1]
        serve.read_until(r"^ready: 2 engine")
        token = peer_token(serve, argv, env)
        assert asyncio.run(serve_requests(address, token, engines=2)) == 24
        assert serve.stop() == 0
