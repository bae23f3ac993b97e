"""The trainer of tests/test_multihost_netns.py, run as its own process in the trainer's network
namespace: it attaches a RolloutManager to engines on other hosts and runs a short GRPO loop
(collect, policy-gradient step, update_weights) while checking, at every version, that every
engine serves its weights. One engine host is killed mid-run by the test; the run goes on.

It talks to the test over stdin/stdout, one line each way: "FREEZE" (stop the victim host),
answered "frozen"; "KILL" once the frozen victim holds requests, answered "killed". What it
observed and checked goes to `--out` as JSON; "DONE" on stdout when that file is written.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from reference import greedy

from rollout.models import build_model
from rollout.models.config import ModelConfig
from rollout.rl.manager import RolloutManager
from rollout.rl.samples import Sample
from rollout.sampling import SamplingParams
from rollout.weights.state import state_dict_checksum

CONFIG = ModelConfig.preset("tiny", vocab_size=259)  # what `--model tiny` loads, seed 0
LENGTH = 12
PROMPTS = [[256, 10 + i, 20, 30, 40, 50] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=LENGTH, ignore_eos=True)
BATCH_GROUPS, GROUP_SIZE = 4, 2
SHORT, LONG = 6, 48  # GRPO completions
NOISE = 0.02


def prompt_source() -> Iterator[dict]:
    """GRPO prompts: even items decode greedily (their every token is checked against the
    reference), odd ones sample (they give the groups reward variance); every other pair is
    long, so the batch is the short groups and the long ones are still generating when the
    trainer suspends and updates: they finish under the next version."""
    for i in itertools.count():
        length = SHORT if i // 2 % 2 == 0 else LONG
        sp = SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
                            num_tokens_to_generate=length, ignore_eos=True)  # fmt: skip
        yield {"prompt": [256, 1 + i % 250, 7, 7, 9], "greedy": i % 2 == 0, "sampling_params": sp}


def reward(sample: Sample) -> float:
    return sum(t % 2 == 0 for t in sample.completion_tokens) / max(len(sample.completion_tokens), 1)


class Trainer:
    """The trainer's model, its weights at every version pushed, and the checks' results."""

    def __init__(self, manager: RolloutManager, victim: int, result: dict[str, Any]) -> None:
        self.manager = manager
        self.cluster = manager.engine.cluster
        self.victim = victim
        self.model = build_model(CONFIG, seed=0)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.snapshots = {0: self._snapshot()}
        self.result = result  # filled in as the run goes: a failure keeps what came before
        result.update(checks=[], acks={}, trainer_checksums={}, engine_versions={}, batches=[])

    def check(self, name: str, ok: bool, detail: Any = None) -> None:
        self.result["checks"].append({"name": name, "ok": bool(ok), "detail": detail})

    def _snapshot(self) -> torch.nn.Module:
        copy = build_model(CONFIG, seed=0).eval()
        copy.load_state_dict(self.model.state_dict())
        return copy

    # -- the loop ---------------------------------------------------------------------------

    def collect(self, source: Iterator[dict]) -> list[Sample]:
        version = self.manager.version
        batch = self.manager.collect(source, BATCH_GROUPS, n=GROUP_SIZE, reward_fn=reward)
        self.check(f"v{version} batch size", len(batch) == BATCH_GROUPS * GROUP_SIZE, len(batch))
        self.check(f"v{version} no failed samples", not any(s.failed for s in batch),
                   [s.error for s in batch if s.failed])  # fmt: skip
        for s in batch:
            self._check_sample(s, version)
        self.result["batches"].append({
            "version": version,
            "token_versions": [s.token_versions for s in batch],
            "policy_staleness": [s.policy_staleness for s in batch],
        })  # fmt: skip
        return batch

    def _check_sample(self, s: Sample, handout: int) -> None:
        name = f"v{handout} group {s.group_id}.{s.index}"
        self.check(f"{name} staleness", not (errs := staleness_errors(s, handout)), errs)
        if s.metadata["greedy"]:
            bad = token_mismatches(s, self.snapshots)
            self.check(f"{name} tokens from their versions' weights", not bad, bad)

    def train_step(self, batch: list[Sample]) -> None:
        """One GRPO step: group-relative advantages, REINFORCE on the trainer's log-probs."""
        self.model.train()
        self.opt.zero_grad()
        loss = torch.zeros(())
        for g in range(0, len(batch), GROUP_SIZE):
            group = batch[g : g + GROUP_SIZE]
            mean = sum(s.reward for s in group) / len(group)
            for s in group:
                loss = loss - (s.reward - mean) * completion_logprob(self.model, s)
        (loss / len(batch)).backward()
        self.opt.step()
        self.perturb()

    @torch.no_grad()
    def perturb(self) -> None:
        """Seeded noise on top of the step: every version decodes differently (so a stale
        engine cannot pass the parity checks), however small the step."""
        g = torch.Generator().manual_seed(len(self.snapshots))
        for p in self.model.parameters():
            p.add_(NOISE * torch.randn(p.shape, generator=g))

    def push(self, version: int, expected_ranks: list[int]) -> None:
        self.manager.update_weights(self.model, version)
        self.snapshots[version] = self._snapshot()
        acks = self.manager.engine.last_sync
        want = state_dict_checksum(self.model)
        self.result["acks"][version] = {int(r): a for r, a in acks.items()}
        self.result["trainer_checksums"][version] = want
        self.check(f"v{version} acked by {expected_ranks}", sorted(acks) == expected_ranks,
                   sorted(acks))  # fmt: skip
        self.check(f"v{version} ack checksums", {a.get("checksum") for a in acks.values()} == {want},
                   {r: a.get("checksum") for r, a in acks.items()})  # fmt: skip
        engines = self.cluster.stats()["engines"]
        self.result["engine_versions"][version] = {int(r): e["weight_version"]
                                                   for r, e in engines.items()}  # fmt: skip
        before = self.snapshots[version - 1]
        changed = any(greedy(before, p, LENGTH) != greedy(self.snapshots[version], p, LENGTH)
                      for p in PROMPTS)  # fmt: skip
        self.check(f"v{version} differs from v{version - 1} in greedy decodes", changed)

    def parity(self, version: int, copies: int, label: str = "") -> list[Sample]:
        got = self.manager.generate(PROMPTS * copies, sampling_params=GREEDY)
        want = [greedy(self.snapshots[version], p, LENGTH) for p in PROMPTS] * copies
        self.check(f"v{version}{label} greedy parity", [s.completion_tokens for s in got] == want,
                   [s.completion_tokens for s in got])  # fmt: skip
        self.check(f"v{version}{label} served at v{version}",
                   all(s.weight_versions == [version] for s in got),
                   [s.weight_versions for s in got])  # fmt: skip
        return got

    # -- the engine host that dies ----------------------------------------------------------

    def kill_victim(self, version: int) -> None:
        """The victim host is frozen, given requests, then killed: they finish elsewhere."""
        counters = self.cluster.stats()["counters"]
        handshake("FREEZE", "frozen")
        watch: dict[str, Any] = {}
        thread = threading.Thread(target=self._kill_when_assigned, args=(watch,), daemon=True)
        thread.start()
        got = self.parity(version, copies=3, label=" (victim frozen, then killed)")
        thread.join(30)
        self.check("victim held requests when killed", watch.get("assigned", 0) > 0, watch)
        self.check("no failed samples after the kill", not any(s.failed for s in got),
                   [s.error for s in got if s.failed])  # fmt: skip
        stats = self.cluster.stats()
        redispatched = stats["counters"].get("redispatched", 0) - counters.get("redispatched", 0)
        self.check("requests re-dispatched", redispatched > 0, stats["counters"])
        self.check("victim left the coordinator", self.victim not in stats["engines"],
                   sorted(stats["engines"]))  # fmt: skip
        self.result["redispatched"] = redispatched

    def _kill_when_assigned(self, watch: dict) -> None:
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                assigned = self.cluster.stats()["engines"][self.victim]["assigned"]
                if assigned:
                    watch["assigned"] = assigned
                    break
                time.sleep(0.05)  # polling the coordinator's view of the frozen victim, bounded
            handshake("KILL", "killed")
        except Exception as e:
            watch["error"] = repr(e)


def handshake(say: str, expect: str) -> None:
    print(say, flush=True)
    line = sys.stdin.readline().strip()
    if line != expect:
        raise RuntimeError(f"said {say!r}, expected {expect!r} back, got {line!r}")


def staleness_errors(s: Sample, handout: int) -> list[str]:
    """Per-token versions and staleness against the versions pushed (0, 1, ..., handout: one
    update each, so U(v) = v)."""
    tv, kv, errs = s.token_versions, s.kv_versions, []
    if len(tv) != len(s.completion_tokens) or len(kv) != len(tv):
        errs.append(
            f"{len(tv)} token / {len(kv)} kv versions for {len(s.completion_tokens)} tokens"
        )
    if tv != sorted(tv) or not set(tv) <= set(range(handout + 1)):
        errs.append(f"token versions {tv} at hand-out version {handout}")
    if s.weight_versions != sorted(set(tv)):
        errs.append(f"weight_versions {s.weight_versions} vs token versions {tv}")
    if s.policy_staleness != [handout - v for v in tv]:
        errs.append(f"policy staleness {s.policy_staleness} for token versions {tv}")
    if not all(t <= k <= handout for t, k in zip(tv, kv, strict=False)):
        errs.append(f"kv versions {kv} outside [token version, {handout}]")
    if s.kv_staleness != [handout - k for k in kv]:
        errs.append(f"kv staleness {s.kv_staleness} for kv versions {kv}")
    return errs


@torch.no_grad()
def token_mismatches(s: Sample, models: dict[int, torch.nn.Module]) -> list:
    """Greedy tokens that the weights of the version they claim would not have chosen (no-cache
    reference: engines recompute in-flight KV at an update, so each token sees one version)."""
    seq, start = s.prompt_tokens + s.completion_tokens, len(s.prompt_tokens)
    bad = []
    for v in sorted(set(s.token_versions)):
        logits = models[v](torch.tensor([seq]))[0, start - 1 : len(seq) - 1]
        chosen = logits.argmax(-1).tolist()
        bad += [(i, v, t, chosen[i]) for i, (tv, t) in enumerate(zip(s.token_versions, s.completion_tokens, strict=True))
                if tv == v and chosen[i] != t]  # fmt: skip
    return bad


def completion_logprob(model: torch.nn.Module, s: Sample) -> torch.Tensor:
    seq, start = s.prompt_tokens + s.completion_tokens, len(s.prompt_tokens)
    logits = model(torch.tensor([seq]))[0, start - 1 : len(seq) - 1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(s.completion_tokens)[:, None]).sum()


def run(args: argparse.Namespace, result: dict) -> None:
    token = Path(args.token_file).read_text().strip()
    options = {"auth_token": token, "weight_sync_host": args.sync_host, "sync_timeout_s": 30.0}
    with RolloutManager(coordinator_address=args.coordinator, dp=args.dp,
                        cluster_options=options) as manager:  # fmt: skip
        t = Trainer(manager, args.victim, result)
        everyone, survivors = list(range(args.dp)), [r for r in range(args.dp) if r != args.victim]
        source = prompt_source()
        for version in range(1, args.versions + 1):
            batch = t.collect(source)
            manager.suspend()  # KV freed for the optimizer; the long groups wait mid-generation
            t.train_step(batch)
            t.push(version, everyone if version <= args.kill_after else survivors)
            manager.resume()
            t.parity(version, copies=2)
            if version == args.kill_after:
                t.kill_victim(version)
        t.collect(source)
        spans = [len(set(v)) for b in result["batches"] for v in b["token_versions"]]
        t.check("some samples span an update", max(spans) > 1, spans)


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--coordinator", "--token-file", "--sync-host", "--out"):
        p.add_argument(name, required=True)
    for name in ("--dp", "--victim", "--versions", "--kill-after"):
        p.add_argument(name, type=int, required=True)
    args = p.parse_args()
    result: dict[str, Any] = {}
    try:
        run(args, result)
    except BaseException:
        result["error"] = traceback.format_exc()
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args.out)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
