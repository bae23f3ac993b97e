"""Multi-turn episodes: the turn loop, its records, and the Sample a trainer gets from them.

An episode is one growing token list: the environment's prompt, then model turn, observation,
model turn, ... Each model turn is an ordinary engine request whose prompt is the whole episode
so far, token ids in, token ids out: nothing already in the episode is re-tokenized, so the
trainer sees exactly the tokens the policy sampled. The engine's prefix cache holds the
episode's KV between turns (the turn's request carries the episode as its routing key, so at
dp > 1 it goes back to the engine that holds that KV) and each turn counts the context it
reused (`Turn.cached_tokens`).

`EpisodeRunner` runs every episode as a coroutine on one asyncio loop in its own thread: while
one episode awaits a tool, the others generate. A model turn is handed to the manager
(`submit`), which runs it on the engine like any request, so episodes cross weight updates as
partial rollouts do, and their per-token versions and staleness are the single-turn ones, turn
by turn (`episode_sample`). An environment that raises or times out fails its episode alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from rollout.request import DynamicInferenceRequest
from rollout.rl.environment import EnvFactory, EnvStep
from rollout.rl.samples import NO_VERSION, Sample, Turn, num_evictions, request_error
from rollout.rl.staleness import VersionHistory, completion_staleness
from rollout.sampling import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["EpisodeLimits", "EpisodeRecord", "EpisodeRunner", "episode_metrics", "episode_sample"]

SubmitTurn = Callable[[list[int], SamplingParams, str], Awaitable[DynamicInferenceRequest]]


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """Bounds every episode: model turns, tokens in all (prompt included), and how long one
    environment call may take."""

    max_turns: int = 8
    max_tokens: int = 4096
    env_timeout_s: float = 60.0


@dataclasses.dataclass
class TurnRecord:
    request: DynamicInferenceRequest  # the turn's merged record
    answer: EnvStep | None  # None when the episode ended before the environment answered
    observation: list[int]  # what was appended after the turn (maybe cut by max_tokens)


@dataclasses.dataclass
class EpisodeRecord:
    """A finished episode, as filed in its group until the trainer takes it."""

    request_id: int  # the first turn's request id (ties the sample to logs)
    prompt: list[int] = dataclasses.field(default_factory=list)
    turns: list[TurnRecord] = dataclasses.field(default_factory=list)
    finish_reason: str = "failed"  # done | max_turns | max_tokens | failed
    error: str | None = None

    def failed(self) -> bool:
        return self.finish_reason == "failed"

    @property
    def reward(self) -> float:
        if self.failed():
            return 0.0
        return sum(t.answer.reward for t in self.turns if t.answer is not None)


@dataclasses.dataclass
class _Job:
    key: str
    example: Any
    env_factory: EnvFactory
    sampling_params: SamplingParams
    on_done: Callable[[EpisodeRecord], None]


class EpisodeRunner:
    """Runs episodes as coroutines on one event loop thread; model turns go to `submit`."""

    def __init__(self, submit: SubmitTurn, limits: EpisodeLimits) -> None:
        self.submit = submit
        self.limits = limits
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Future] = set()
        self._thread = threading.Thread(target=self._run_loop, name="rollout-env", daemon=True)
        self._thread.start()

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    def start(
        self,
        key: str,
        example: Any,
        env_factory: EnvFactory,
        sampling_params: SamplingParams,
        on_done: Callable[[EpisodeRecord], None],
    ) -> None:
        """Start one episode; `on_done(record)` is called from the loop thread when it ends."""
        job = _Job(key, example, env_factory, sampling_params, on_done)
        fut = asyncio.run_coroutine_threadsafe(self._episode(job), self.loop)
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Cancel running episodes and stop the loop thread."""
        if not self._thread.is_alive():
            return
        for fut in list(self._tasks):
            fut.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    async def _episode(self, job: _Job) -> None:
        record = EpisodeRecord(request_id=-1)
        env = None
        try:
            env = job.env_factory(job.example)
            await self._play(env, job, record)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the environment or a turn failed: this episode alone
            record.finish_reason = "failed"
            record.error = record.error or f"{type(e).__name__}: {e}"
        finally:
            if env is not None:
                await self._close_env(env)
        job.on_done(record)

    async def _play(self, env: Any, job: _Job, record: EpisodeRecord) -> None:
        lim = self.limits
        prompt = _token_ids("reset", await self._env_call(env.reset(job.example)))
        if not prompt:
            raise ValueError("the environment's reset returned no prompt tokens")
        record.prompt = prompt
        context = list(prompt)
        sp = env.sampling_params(job.sampling_params)
        for _ in range(lim.max_turns):
            budget = lim.max_tokens - len(context)
            if budget <= 0:
                record.finish_reason = "max_tokens"
                return
            if sp.num_tokens_to_generate > budget:
                sp_turn = sp.replace(num_tokens_to_generate=budget)
            else:
                sp_turn = sp
            req = await self.submit(list(context), sp_turn, job.key)
            if record.request_id < 0:
                record.request_id = req.request_id
            if req.failed():
                record.error = f"turn {len(record.turns)}: {request_error(req)}"
                raise RuntimeError(record.error)
            turn = TurnRecord(req, None, [])
            record.turns.append(turn)
            generated = list(req.generated_tokens)
            context += generated
            answer = await self._env_call(env.step(generated))
            _check_answer(answer)
            turn.answer = answer
            obs = _token_ids("step observation", answer.observation)
            if answer.done:
                record.finish_reason = "done"
                return
            room = lim.max_tokens - len(context)
            turn.observation = obs[: max(room, 0)]
            context += turn.observation
            if len(obs) > room:
                record.finish_reason = "max_tokens"
                return
        record.finish_reason = "max_turns"

    async def _env_call(self, coro: Awaitable[Any]) -> Any:
        try:
            return await asyncio.wait_for(coro, self.limits.env_timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"environment call exceeded {self.limits.env_timeout_s}s") from e

    async def _close_env(self, env: Any) -> None:
        with contextlib.suppress(Exception):  # closing is best effort; the episode is decided
            await asyncio.wait_for(env.close(), self.limits.env_timeout_s)


def _check_answer(answer: Any) -> None:
    """An EnvStep whose reward and info are numbers (they are summed at hand-out)."""
    if not isinstance(answer, EnvStep):
        raise TypeError(f"Environment.step must return EnvStep, got {type(answer).__name__}")
    if isinstance(answer.reward, bool) or not isinstance(answer.reward, (int, float)):
        raise TypeError(f"EnvStep.reward must be a number, got {answer.reward!r:.80}")
    info = answer.info
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) for k, v in info.items()
    ):
        raise TypeError(f"EnvStep.info must map str to numbers, got {info!r:.200}")


def _token_ids(what: str, ids: Any) -> list[int]:
    """`ids` as a list of ints, or a TypeError naming the call that produced them."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise TypeError(
            f"Environment {what} must be a list of token ids (ints >= 0), got {ids!r:.200}"
        )
    return list(ids)


def episode_sample(
    ep: EpisodeRecord, group_id: int, index: int, metadata: Any, history: VersionHistory
) -> Sample:
    """Cut the trainer's Sample from an episode: the model turns' tokens with their behaviour
    log-probs, versions and staleness as of now (loss mask 1), the observations between them
    (loss mask 0)."""
    s = Sample(
        group_id=group_id, index=index, request_id=ep.request_id, prompt=None,
        prompt_tokens=list(ep.prompt), completion_tokens=[], completion_text=None, logprobs=[],
        policy_staleness=[], kv_staleness=[], token_versions=[], kv_versions=[],
        weight_versions=[], finish_reason=ep.finish_reason, reward=ep.reward, metadata=metadata,
        failed=ep.failed(), error=ep.error, loss_mask=[],
    )  # fmt: skip
    versions: set[int] = set()
    for t in ep.turns:
        _append_turn(s, t, history)
        versions.update(t.request.generated_weight_versions)
        for k, v in (t.answer.info if t.answer is not None else {}).items():
            s.env_info[k] = s.env_info.get(k, 0.0) + float(v)
    s.weight_versions = sorted(versions)
    return s


def _append_turn(s: Sample, t: TurnRecord, history: VersionHistory) -> None:
    req = t.request
    st = completion_staleness(req, history)
    n, obs = len(req.generated_tokens), t.observation
    s.turns.append(Turn(
        start=len(s.completion_tokens), num_tokens=n, num_observation_tokens=len(obs),
        context_tokens=req.prompt_length, cached_tokens=int(getattr(req, "cached_tokens", 0)),
        reward=0.0 if t.answer is None else float(t.answer.reward),
        finish_reason=req.stop_reason, weight_versions=req.weight_versions,
        max_policy_staleness=max(st.policy, default=0), max_kv_staleness=max(st.kv, default=0),
    ))  # fmt: skip
    s.num_evictions += num_evictions(req)
    s.completion_tokens += list(req.generated_tokens) + obs
    s.loss_mask += [1] * n + [0] * len(obs)
    s.logprobs += list(req.generated_log_probs) + [0.0] * len(obs)
    s.policy_staleness += st.policy + [0] * len(obs)
    s.kv_staleness += st.kv + [0] * len(obs)
    s.token_versions += st.token_versions + [NO_VERSION] * len(obs)
    s.kv_versions += st.kv_versions + [NO_VERSION] * len(obs)


def episode_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per-batch episode metrics: turns, environment counts (tool calls, errors, ...), KV reuse
    of the turns after the first, and policy staleness per turn index."""
    eps = [s for s in samples if s.is_episode]
    if not eps:
        return {}
    n = len(eps)
    out: dict[str, float] = {
        "rollout/batch_episodes": n,  # this batch; stats() hold the running episodes_* counts
        "rollout/turns_per_episode": sum(len(s.turns) for s in eps) / n,
        "rollout/batch_episodes_failed": sum(s.failed for s in eps),
        "rollout/observation_tokens_per_episode": sum(
            len(s.completion_tokens) - s.num_model_tokens for s in eps
        ) / n,
    }  # fmt: skip
    for key in sorted({k for s in eps for k in s.env_info}):
        out[f"rollout/{key}"] = sum(s.env_info.get(key, 0.0) for s in eps) / n
    later = [t for s in eps for t in s.turns[1:]]
    context = sum(t.context_tokens for t in later)
    out["rollout/kv_reuse_ratio"] = (
        sum(t.cached_tokens for t in later) / context if context else 0.0
    )
    out["rollout/turn_tokens_computed"] = sum(t.computed_tokens for s in eps for t in s.turns)
    out["rollout/turn_tokens_reused"] = sum(t.cached_tokens for s in eps for t in s.turns)
    for k in range(max(len(s.turns) for s in eps)):
        turns = [s.turns[k] for s in eps if len(s.turns) > k]
        out[f"staleness/turn{k}_policy_max"] = max(t.max_policy_staleness for t in turns)
        out[f"staleness/turn{k}_policy_mean"] = sum(t.max_policy_staleness for t in turns) / len(
            turns
        )
        out[f"staleness/turn{k}_kv_max"] = max(t.max_kv_staleness for t in turns)
    return out
