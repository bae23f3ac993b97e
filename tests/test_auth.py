"""rollout.serving.auth: where a token comes from, and how it is compared."""

from __future__ import annotations

import pytest

from rollout.serving.auth import (
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    new_token,
    read_token_file,
    resolve_token,
    tokens_match,
)
from rollout.serving.coordinator import CoordinatorConfig, DataParallelInferenceCoordinator


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    monkeypatch.delenv(ENV_TOKEN_FILE, raising=False)


def test_new_tokens_are_long_and_distinct():
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(len(t) >= 43 for t in tokens)  # 32 random bytes, URL-safe base64


def test_resolve_order_explicit_then_file_then_env_then_env_file(tmp_path, monkeypatch):
    f1, f2 = tmp_path / "a", tmp_path / "b"
    f1.write_text("from-file\n")
    f2.write_text("  from-env-file  ")
    assert resolve_token() is None
    monkeypatch.setenv(ENV_TOKEN_FILE, str(f2))
    assert resolve_token() == "from-env-file"
    monkeypatch.setenv(ENV_TOKEN, "from-env")
    assert resolve_token() == "from-env"
    assert resolve_token(token_file=f1) == "from-file"
    assert resolve_token("explicit", token_file=f1) == "explicit"


def _empty_file(d):
    (d / "empty").write_text("\n")
    return d / "empty"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d: read_token_file(_empty_file(d)), "is empty"),
        (lambda d: resolve_token(token_file=d / "missing"), "cannot read auth token file"),
        (lambda d: resolve_token(""), "non-empty str"),
    ],
    ids=["empty-file", "missing-file", "empty-str"],
)
def test_bad_token_sources_raise_clear_errors(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(tmp_path)


def test_tokens_match_only_the_same_str():
    assert tokens_match("abc", "abc")
    assert not tokens_match("abd", "abc")
    assert not tokens_match(None, "abc")
    assert not tokens_match(b"abc", "abc")
    assert not tokens_match("x" * 5000, "x" * 5000)  # over MAX_TOKEN_CHARS: refused unread


def test_coordinator_generates_a_token_unless_told_otherwise(monkeypatch, tmp_path):
    a = DataParallelInferenceCoordinator()
    b = DataParallelInferenceCoordinator()
    try:
        assert a.auth_token and b.auth_token and a.auth_token != b.auth_token
    finally:
        a.stop()
        b.stop()
    monkeypatch.setenv(ENV_TOKEN, "env-secret")
    c = DataParallelInferenceCoordinator()
    open_ = DataParallelInferenceCoordinator(allow_unauthenticated=True)
    try:
        assert c.auth_token == "env-secret"
        assert open_.auth_token is None
    finally:
        c.stop()
        open_.stop()
    with pytest.raises(ValueError, match="contradicts"):
        CoordinatorConfig(auth_token="x", allow_unauthenticated=True)


def test_spawned_coordinator_reports_its_generated_token():
    proc, address, token = DataParallelInferenceCoordinator.spawn()
    try:
        assert address.startswith("tcp://127.0.0.1:") and token and len(token) >= 43
    finally:
        proc.kill()
        proc.join(5)
