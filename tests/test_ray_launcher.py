"""rollout.launcher=ray on a real multi-node Ray cluster on one machine (`ray.cluster_utils`):
a head node (the trainer and the coordinator, no GPU) and two worker nodes with fake GPUs, each
node's object store bounded, Ray's token authentication disabled explicitly (a local test
cluster; RAY_AUTH_MODE). Engines run on CPU inside bundles that hold a fake GPU, so the
placement, CUDA_VISIBLE_DEVICES plumbing, weight transport and failover are Ray's real ones.

- A GRPO loop at dp=2, one engine per worker node, learns exactly as the same loop does on local
  engine processes: seeded samples from batch-invariant engines, no partial rollouts, so both
  runs log the same rewards bit for bit; every token stamped with a version the trainer pushed.
- A worker node removed mid-generation loses nothing: every sample completes exactly once with
  exact versions, and its engine comes back in a bundle Ray re-placed on the other worker node,
  serving only once it holds the trainer's weights (greedy decoding equals the trainer's).
- The main job (recipes.grpo_reverse) runs with rollout.launcher=ray on the cluster.
"""

from __future__ import annotations

import copy
import os
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from reference import greedy  # noqa: E402

from recipes.common import run_recipe  # noqa: E402
from rollout.config import compose, validate  # noqa: E402
from rollout.config.builders import build_manager, build_model_and_tokenizer  # noqa: E402
from rollout.sampling import SamplingParams  # noqa: E402
from trainer_hooks.loop import train  # noqa: E402

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(900)]

STORE = 100 << 20  # object store bytes per node (Ray's minimum is ~75 MB)
SEED = 1  # every sample's stream seeded (per sample), so both runs draw the same tokens
HALF = 128  # the reward: the share of completion tokens below it (about half at random init)
PROMPTS = [[256, *b"hello"], [256, *b"world"], [256, *b"ray!"], [256, *b"abc"]]
RUN = [
    "rollout.dp=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
    "rollout.prompts_per_step=4", "rollout.partial_rollouts=false",  # each batch: the groups sent
    "engine.block_size=4", "engine.num_blocks=128", "engine.max_sequence_length=256",
    "engine.streaming_interval=4",  # failover checkpoints every 4 tokens
    "coordinator.heartbeat_s=0.3", "coordinator.engine_timeout_s=2.0",
    "coordinator.policy=round_robin", "coordinator.restart_backoff_s=0.0",
    "engine.batch_invariant=true",  # seeded samples: the same bits on any engine, in any batch
]  # fmt: skip
RAY = ["rollout.launcher=ray", "rollout.ray.placement_strategy=SPREAD",
       "rollout.ray.gpus_per_engine=1", "rollout.ray.cpus_per_engine=1"]  # fmt: skip


def wait_for(condition, timeout_s: float, what: str):
    """Poll `condition` until it returns something truthy (a condition on state Ray owns)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = condition()
        if out:
            return out
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # token auth off for this local cluster, explicitly
    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "object_store_memory": STORE, "_system_config": fast})  # fmt: skip
    workers = [c.add_node(num_cpus=2, num_gpus=g, object_store_memory=STORE) for g in (2, 1)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old


def _reward(sample) -> float:
    return sum(t < HALF for t in sample.completion_tokens) / len(sample.completion_tokens)


def _grpo(overrides: list[str]) -> tuple[list[float], dict]:
    """Eight GRPO steps from seed 0; (mean reward per step, what the run saw)."""
    run = validate(compose([*RUN, *overrides]))
    model, tok, _ = build_model_and_tokenizer(run)
    manager = build_manager(run, model=model, tokenizer=tok)
    seen: dict = {"versions": set(), "pushed": {manager.version}}
    try:
        cluster = manager.engine.cluster
        if cluster.remote:
            seen["where"] = [p.where(30.0) for p in cluster.engine_processes]
            seen["transport"] = cluster.weight_sync_transport
        opt = torch.optim.Adam(model.parameters(), lr=3e-2)
        prompts = iter(PROMPTS * 100)
        sp = SamplingParams(temperature=1.0, num_tokens_to_generate=8, ignore_eos=True,
                            return_log_probs=True, seed=SEED)  # fmt: skip

        def on_step(step: int, metrics: dict) -> None:
            seen["pushed"].add(manager.version)

        history = train(manager, model, opt, prompts, 8, 4, 4, _reward, sp, on_step=on_step)
        manager.resume()  # colocated: the loop leaves the engines suspended
        samples = manager.generate(PROMPTS, n=4, sampling_params=sp)
        for s in samples:
            seen["versions"].update(s.token_versions)
        seen["final"] = sum(map(_reward, samples)) / len(samples)
        seen["stats"] = manager.engine.cluster.stats()
    finally:
        manager.close()
    return [h["train/reward_mean"] for h in history], seen


def test_grpo_on_two_ray_nodes_learns_as_local_processes_do(cluster):
    _, workers = cluster
    local_rewards, local = _grpo([])
    ray_rewards, on_ray = _grpo(RAY)
    print("rewards local", local_rewards, local["final"], "ray", ray_rewards, on_ray["final"])
    worker_ids = {w.node_id for w in workers}
    nodes = [w["node_id"] for w in on_ray["where"]]
    assert len(set(nodes)) == 2 and set(nodes) <= worker_ids, on_ray["where"]  # one per worker
    assert all(w["gpu_ids"] and w["cuda_visible_devices"] == w["gpu_ids"][0]
               for w in on_ray["where"]), on_ray["where"]  # fmt: skip  # Ray's GPU, Ray's env
    assert on_ray["transport"] == "broadcast"  # the engines are off the trainer's node
    assert ray_rewards == local_rewards and on_ray["final"] == local["final"]  # bit for bit
    for rewards, seen in ((local_rewards, local), (ray_rewards, on_ray)):
        assert seen["versions"] <= seen["pushed"], seen  # every token from a pushed version
        assert seen["final"] > rewards[0] + 0.2, (rewards, seen["final"])  # it learned
        engines = seen["stats"]["engines"]
        assert {e["weight_version"] for e in engines.values()} == {max(seen["pushed"])}


def test_node_removed_mid_run_loses_nothing_and_engine_returns_with_trainer_weights(cluster):
    c, workers = cluster
    run = validate(compose([*RUN, *RAY]))
    model, tok, _ = build_model_and_tokenizer(run)
    events: list[tuple] = []
    manager = build_manager(run, model=model, tokenizer=tok)
    cl = manager.engine.cluster
    cl.on_event = cl.supervisor.on_event = lambda kind, rank, details: events.append(
        (kind, rank, details)
    )
    try:
        with torch.no_grad():  # the trainer's weights, not the checkpoint's
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        version = manager.update_weights(model)
        doomed = workers[1]  # one GPU: it holds exactly one engine; the other worker has a spare
        where = {r: p.where(30.0) for r, p in enumerate(cl.engine_processes)}
        (rank,) = [r for r, w in where.items() if w["node_id"] == doomed.node_id]
        sp = SamplingParams(temperature=0.0, num_tokens_to_generate=120, ignore_eos=True)
        prompts = [[256, *f"prompt {i}".encode()] for i in range(12)]
        out: dict = {}
        gen = threading.Thread(target=lambda: out.update(s=manager.generate(prompts, n=2,
                                                                           sampling_params=sp)))  # fmt: skip
        gen.start()
        wait_for(lambda: cl.stats()["engines"].get(rank, {}).get("assigned", 0) > 0, 120,
                 f"engine {rank} to hold requests")  # fmt: skip
        c.remove_node(doomed, allow_graceful=False)
        gen.join(600)
        samples = out["s"]
        assert len(samples) == 24 and len({s.request_id for s in samples}) == 24
        assert all(not s.failed and len(s.completion_tokens) == 120 for s in samples)
        assert all(s.token_versions == [version] * 120 for s in samples)  # exact versions
        trainer = copy.deepcopy(model).eval()
        for p, s in zip([p for p in prompts for _ in range(2)], samples, strict=True):
            assert s.completion_tokens == greedy(trainer, p, 120)  # nothing garbled on failover

        def back():
            engines = cl.stats()["engines"]
            ok = len(engines) == 2 and not any(e["syncing"] for e in engines.values())
            return ok and cl.engine_processes[rank].where(5.0)

        moved = wait_for(back, 300, f"engine {rank} re-placed and caught up")
        assert moved["node_id"] == workers[0].node_id != doomed.node_id  # another node
        assert ("caught_up", rank) in [(k, r) for k, r, _ in events], events
        assert any(k == "restarted" and r == rank for k, r, _ in events), events
        caught = [d for k, r, d in events if k == "caught_up" and r == rank][-1]
        assert caught["weight_version"] == version and caught["checksum"] == (
            manager.engine.last_sync[1 - rank]["checksum"])  # the trainer's weights  # fmt: skip
        short = [[256, *b"after"], [256, *b"failover"]]
        got = manager.generate(short, n=2, sampling_params=sp.replace(num_tokens_to_generate=8))
        assert [s.completion_tokens for s in got] == [greedy(trainer, p, 8) for p in short for _ in range(2)]  # fmt: skip
    finally:
        manager.close()


def test_main_job_runs_with_launcher_ray_on_the_cluster(cluster, tmp_path):
    """The main job (recipes.grpo_reverse) with rollout.launcher=ray, dp=2 spread over the two
    worker nodes: it trains, and every step's weights reach both engines."""
    short = ["trainer.steps=3", "trainer.warmup_sft_steps=2", "trainer.batch=4",
             "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
             "rollout.max_new_tokens=6", "recipe.eval_every=0", "logger=disabled",
             f"logger.dir={tmp_path}"]  # fmt: skip
    summary = run_recipe(compose([*short, "rollout.dp=2", *RAY]))
    assert summary["steps"] == 3 and summary["final_version"] == 3, summary
