"""An independent staleness oracle: what each engine actually did, step by step.

`instrument(engine, log_path)` wraps a real `DynamicInferenceEngine` so that it appends one JSON
line per event to `log_path`: its start, every weight update it applied, and for every step the
positions whose KV it computed and the tokens it sampled, per request (keyed by the request's
first prompt, which the tests keep unique). Nothing is read from version stamps or staleness
counters. `expected(...)` replays the logs of every engine (one file per process) and derives,
per completion token, how many updates its sampling step and the last computation of its KV had
seen; the tests compare those with what the manager handed out.

`build_engine` is an `EngineCluster(engine_factory=...)` factory: engine processes at dp > 1 log
the same way (functools.partial fixes `log_dir`; spawned children import this module).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.serving import factory


def _key(seq: Any) -> str:
    return ",".join(map(str, seq.record.requests[0].prompt_tokens.tolist()))


def instrument(engine: Any, log_path: str | os.PathLike) -> Any:
    """Make `engine` log its updates, KV computations and samples to `log_path`."""
    out = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the engine
    scheduled: list = []

    def write(event: dict) -> None:
        event["t"] = time.time()
        out.write(json.dumps(event) + "\n")

    schedule = engine.scheduler.schedule

    def logged_schedule(version: int) -> Any:
        batch = schedule(version)
        scheduled[:] = [(seq, seq.num_computed, n, seq.num_generated) for seq, n in batch]
        return batch

    step = engine.step

    def logged_step() -> Any:
        scheduled.clear()
        result = step()
        if scheduled:
            write({
                "ev": "step",
                "computed": [[_key(s), start, n] for s, start, n, _ in scheduled],
                "sampled": [[_key(s), s.num_generated - 1, s.tokens[-1]]
                            for s, _, _, before in scheduled if s.num_generated > before],
            })  # fmt: skip
        return result

    update = engine.update_weights

    def logged_update(state_dict: Any, version: int) -> None:
        update(state_dict, version)
        write({"ev": "update"})

    flip = engine.flip_weights

    def logged_flip(staged: Any) -> None:  # a staged update's weights change here
        flip(staged)
        write({"ev": "update"})

    engine.scheduler.schedule = logged_schedule
    engine.flip_weights = logged_flip
    engine.step = logged_step
    engine.update_weights = logged_update
    write({"ev": "start", "version": int(engine.weight_version), "pid": os.getpid()})
    return engine


def build_engine(log_dir: str, **kwargs: Any) -> Any:
    """Worker-process factory: the standard engine, instrumented, one log file per process."""
    return instrument(factory.build_engine(**kwargs), Path(log_dir) / f"engine-{os.getpid()}.jsonl")


@dataclass
class _Request:
    sampled: dict[int, tuple[float, int, int]] = field(default_factory=dict)  # idx -> (t, u, tok)
    computed: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, u, start, n)


@dataclass
class Expected:
    tokens: list[int]
    sampled_updates: list[int]  # per completion token: updates its engine had applied
    kv_updates: list[int]  # per completion token: the same, when its KV was last computed


def replay(log_dir: str | os.PathLike, history: list[int]) -> dict[str, _Request]:
    """Every engine log in `log_dir` replayed: per request key, what was sampled and computed
    and after how many weight updates (an engine's own count since its start version)."""
    requests: dict[str, _Request] = {}
    for path in sorted(Path(log_dir).glob("engine-*.jsonl")):
        updates = 0
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev["ev"] == "start":
                updates = history.index(ev["version"])
            elif ev["ev"] == "update":
                updates += 1
            else:
                for key, start, n in ev["computed"]:
                    requests.setdefault(key, _Request()).computed.append(
                        (ev["t"], updates, start, n)
                    )
                for key, idx, tok in ev["sampled"]:
                    r = requests.setdefault(key, _Request())
                    if (
                        idx not in r.sampled or r.sampled[idx][0] <= ev["t"]
                    ):  # re-sampled: last wins
                        r.sampled[idx] = (ev["t"], updates, tok)
    return requests


def expected(sample: Any, requests: dict[str, _Request]) -> Expected:
    """What the sample's per-token update counts must be, from the logs alone.

    Token i (position p = prompt + i) was sampled in the step that logged it. Its KV is the last
    computation of position p before the request finished; a final token was never fed back,
    so its KV counts as computed when it was sampled. Positions served from the prefix cache
    without a computation of their own count as computed at the first step that held them
    (cached blocks are never older than the engine's weights).
    """
    r = requests[",".join(map(str, sample.prompt_tokens))]
    n, p0 = len(sample.completion_tokens), len(sample.prompt_tokens)
    finish = r.sampled[n - 1][0]
    sampled = [r.sampled[i] for i in range(n)]
    kv = []
    for i in range(n):
        p = p0 + i
        covering = [(t, u) for t, u, s, c in r.computed if s <= p < s + c and t <= finish]
        held = [(t, u) for t, u, s, _ in r.computed if p < s and t <= finish]
        if i == n - 1 and not [c for c in covering if c[0] > sampled[i][0]]:
            kv.append(sampled[i][1])
        elif covering:
            kv.append(max(covering)[1])
        else:
            kv.append(min(held)[1])
    return Expected([s[2] for s in sampled], [s[1] for s in sampled], kv)
