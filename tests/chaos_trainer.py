"""The trainer of tests/test_chaos_trust.py, in a process of its own so that the test can freeze
it (SIGSTOP) and thaw it. A GRPO loop on a RolloutManager at dp=2 (real engine processes): each
step collects groups, checks every sample against the versions this trainer pushed, takes an
optimizer step and pushes the weights, while the step's fault is injected:

- unread: an HTTP front end on the manager's coordinator takes streams whose sockets are never
  read (issue 31, defect 1); the loop collects as usual, the streams' budget comes back once the
  engines are done (an honest caller is admitted) and their connections are aborted at the
  write-idle timeout;
- ipc: a local attacker rewrites the staged payload and the trainer's buckets between the
  trainer's publishing and the engines' reading (finding 1);
- aborts: it pre-writes the abort key of the next 3,000 generations (finding 2);
- group: it points the engines at a process group of its own before a broadcast (finding 13);
- engine: engine 1 is SIGKILLed after the update; the supervisor restarts it (finding 14);
- freeze: the trainer tells the test to freeze it, then collects again (finding 15);
- coordinator: the embedded coordinator is SIGKILLed during `collect`, which must raise; the
  loop builds a new manager from the trainer's current weights (finding 6).

One JSON line per event on stdout; the last one ("done") carries the counts the test asserts.
Every check that fails raises, and the process exits non-zero with the traceback on stderr.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import torch
import uvicorn
from reference import greedy
from safetensors.torch import save_file
from test_weight_path_trust import ATTACKER
from test_weights_ipc import _run

from rollout.config import validate
from rollout.config.builders import (
    build_model_and_tokenizer,
    cluster_options,
    inference_config,
    manager_config,
)
from rollout.engine.interface import EngineLost
from rollout.rl.manager import RolloutManager
from rollout.sampling import SamplingParams
from rollout.serving.http.app import build_app
from rollout.serving.http.limits import Limits
from rollout.serving.http.server import ConnectionLimits, uvicorn_config
from rollout.weights.broadcast import WeightSyncError
from rollout.weights.state import state_dict_checksum

SAMPLE = SamplingParams(temperature=1.0, num_tokens_to_generate=6, ignore_eos=True,
                        return_log_probs=True)  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, num_tokens_to_generate=6, ignore_eos=True)
PROMPTS = [[256, *b"hello world!"], [256, *b"reverse me"]]
GROUP = 4  # samples per prompt
LOGPROB_TOL = 1e-4


T0 = time.monotonic()


def emit(event: str, **fields) -> None:
    """One event line; `t` (seconds since start) tells where a slow run spends its time."""
    print(json.dumps({"event": event, "t": round(time.monotonic() - T0, 1), **fields}), flush=True)


class Trainer:
    def __init__(self, schedule: list[str], client_timeout_s: float) -> None:
        self.schedule, self.client_timeout_s = schedule, client_timeout_s
        self.run = _run()
        self.run.coordinator.restart_backoff_s = 0.0
        self.model, self.tok, _ = build_model_and_tokenizer(validate(self.run))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.versions: dict[int, dict[str, torch.Tensor]] = {}  # every version pushed
        self.counts = {"applied": 0, "refused": 0, "samples": 0, "tokens_checked": 0,
                       "greedy_checked": 0, "coordinator_errors": 0, "managers": 0,
                       "restarted_engines": 0, "attacker_writes": 0, "rejoins": 0,
                       "unread_aborted": 0, "honest_admitted": 0}  # fmt: skip
        self.refusals: list[str] = []
        self.evil = f"/tmp/rollout-chaos-zeros-{os.getpid()}.safetensors"
        save_file({k: torch.zeros_like(v) for k, v in self.model.state_dict().items()}, self.evil)
        self.manager = self._new_manager(first=True)

    # ---- the manager -----------------------------------------------------------------------

    def _new_manager(self, first: bool = False) -> RolloutManager:
        run = validate(self.run)
        options = cluster_options(run)
        options["coordinator"]["client_timeout_s"] = self.client_timeout_s
        m = RolloutManager(manager_config(run, dp=2, collect_timeout_s=120.0), model=self.model, tokenizer=self.tok,
                           inference_config=inference_config(run), cluster_options=options)  # fmt: skip
        m.engine.cluster.sync.bucket_bytes = 32 << 10
        m.engine.cluster.sync.timeout_s = 20.0  # an update the attacker stalls fails in 20 s
        self.counts["managers"] += 1
        if first:
            self.versions[m.version] = self._snapshot()
        else:  # the new engines start from the trainer's weights: label them as the next version
            self._push(m, max(self.versions) + 1)
        return m

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    # ---- checks ----------------------------------------------------------------------------

    def _model_of(self, version: int) -> torch.nn.Module:
        model = copy.deepcopy(self.model).eval()
        model.load_state_dict(self.versions[version])
        return model

    @torch.no_grad()
    def check_samples(self, samples) -> None:
        """Every sample: not failed, every token sampled by a version this trainer pushed, its
        behaviour log-prob that version's (recomputed without a cache)."""
        models: dict[int, torch.nn.Module] = {}
        for s in samples:
            assert not s.failed, s.error
            assert len(s.token_versions) == len(s.completion_tokens) == len(s.logprobs) == 6
            unknown = set(s.token_versions) - set(self.versions)
            assert not unknown, f"tokens stamped with versions never pushed: {unknown}"
            seq = torch.tensor([s.prompt_tokens + s.completion_tokens])
            for i, (tok, v, lp) in enumerate(
                zip(s.completion_tokens, s.token_versions, s.logprobs, strict=True)
            ):
                model = models.setdefault(v, self._model_of(v))
                logits = model(seq[:, : len(s.prompt_tokens) + i])[0, -1]
                want = torch.log_softmax(logits.float(), -1)[tok].item()
                assert abs(want - lp) < LOGPROB_TOL, (s.request_id, i, v, want, lp)
                self.counts["tokens_checked"] += 1
            self.counts["samples"] += 1

    def check_serving(self, m: RolloutManager) -> None:
        """Both engines hold the trainer's current version and decode exactly like it."""
        version = m.version
        engines = m.engine.cluster.stats()["engines"]
        assert sorted(engines) == [0, 1] and {e["weight_version"] for e in engines.values()} == {
            version
        }, engines
        model = self._model_of(version)
        want = [greedy(model, p, 6) for p in PROMPTS]
        got = m.generate(PROMPTS, n=2, sampling_params=GREEDY)  # round robin: both engines
        assert [s.completion_tokens for s in got] == [w for w in want for _ in range(2)]
        assert all(s.token_versions == [version] * 6 for s in got)
        self.counts["greedy_checked"] += len(got)

    # ---- the loop --------------------------------------------------------------------------

    def grpo_step(self, samples) -> None:
        """One policy-gradient step: reward = share of even tokens, advantage within groups."""
        rewards = torch.tensor([sum(t % 2 == 0 for t in s.completion_tokens) / 6 for s in samples])
        adv = (rewards.view(-1, GROUP) - rewards.view(-1, GROUP).mean(1, keepdim=True)).flatten()
        loss = torch.zeros(())
        for s, a in zip(samples, adv, strict=True):
            seq = torch.tensor([s.prompt_tokens + s.completion_tokens])
            logp = torch.log_softmax(self.model(seq)[0, len(s.prompt_tokens) - 1 : -1], -1)
            loss = loss - a * logp.gather(1, torch.tensor(s.completion_tokens)[:, None]).sum()
        self.opt.zero_grad()
        (loss / len(samples) + 0.0 * sum(p.sum() for p in self.model.parameters())).backward()
        self.opt.step()

    def _push(self, m: RolloutManager, version: int | None = None) -> bool:
        """Push the trainer's weights: applied with the trainer's own checksum on every engine,
        or refused with a clear error and every engine still on the previous version."""
        old = m.version
        try:
            version = m.update_weights(self.model, version)
        except WeightSyncError as e:
            assert str(e)
            self.refusals.append(str(e))
            self.counts["refused"] += 1
            self.check_serving(m)  # still the previous version, everywhere
            assert m.version == old
            return False
        self.versions[version] = self._snapshot()
        acks = m.engine.last_sync
        assert sorted(acks) == [0, 1], acks
        assert {a["checksum"] for a in acks.values()} == {state_dict_checksum(self.model)}, acks
        assert {a["received"] for a in acks.values()} == {m.engine.cluster.sync.digest}, acks
        self.counts["applied"] += 1
        self.check_serving(m)
        return True

    def collect(self, m: RolloutManager):
        prompts = iter([PROMPTS[i % 2] for i in range(10_000)])
        return m.collect(prompts, 2, n=GROUP, sampling_params=SAMPLE)

    def step(self, fault: str) -> None:
        m = self.manager
        if fault == "coordinator":
            self.kill_coordinator_in_collect()
            return
        if fault == "freeze":
            emit("freeze", pid=os.getpid())
            sys.stdin.readline()  # the test froze this process and thawed it
        if fault == "unread":
            with UnreadStreams(m) as unread:
                samples = self.collect(m)
                self.counts["honest_admitted"] += unread.honest_admitted()
                self.counts["unread_aborted"] += unread.aborted()
        else:
            samples = self.collect(m)
        if fault == "freeze":
            self.counts["rejoins"] += getattr(m.engine.cluster.client, "rejoins", 0)
        self.check_samples(samples)
        self.grpo_step(samples)
        sync = m.engine.cluster.sync
        if fault == "ipc":
            sync.transport = "ipc"
            transfer = sync.transfer

            def attacked(sd, version, members, on_bucket, announce):
                def attack_then_announce():
                    self.attack("ipc", version)
                    return announce()

                return transfer(sd, version, members, on_bucket, attack_then_announce)

            sync.transfer = attacked
            try:
                self._push(m)
            finally:
                del sync.transfer
        elif fault == "aborts":
            self.attack("aborts", 0)
            sync.transport = "broadcast"
            sync.broken()  # the next update forms a new generation: the next number
            self._push(m)
        elif fault == "group":
            sync.transport = "broadcast"
            intruder = self.attacker("group", m.version + 1)
            try:
                assert intruder.stdout.readline()  # its keys are in the store before the update
                self._push(m)
                assert intruder.poll() is None  # still waiting for engines that never came
            finally:
                intruder.kill()
                intruder.wait(30)
        else:
            self._push(m)
        if fault == "engine":
            self.kill_engine(m)

    def attacker(self, attack: str, version: int) -> subprocess.Popen:
        port = self.manager.engine.cluster.sync.store.port
        args = [attack, str(port), str(os.getpid()), str(version), self.evil]
        return subprocess.Popen([sys.executable, "-c", ATTACKER, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip

    def attack(self, attack: str, version: int) -> None:
        proc = self.attacker(attack, version)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        report = json.loads(out.splitlines()[-1])
        assert not report["payload_replaced"], report
        if attack == "aborts":
            self.counts["attacker_writes"] += report["bytes_written"]
        else:
            assert report["bytes_written"] == 0 and report["denied"] >= 2, report

    def kill_engine(self, m: RolloutManager) -> None:
        """SIGKILL engine 1; wait until the supervisor's new process registered and takes work."""
        cluster = m.engine.cluster
        before = cluster.stats()["counters"]["engines_registered"]
        os.kill(cluster.engine_processes[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            s = cluster.stats()
            back = s["counters"]["engines_registered"] > before and 1 in s["engines"]
            if back and not s["engines"][1]["syncing"]:
                break
            assert time.monotonic() < deadline, s
            time.sleep(0.1)  # polling the coordinator's view of its engines, bounded
        self.counts["restarted_engines"] += 1
        self.check_serving(m)  # the returning engine holds the trainer's current weights

    def kill_coordinator_in_collect(self) -> None:
        m = self.manager
        pid = m.engine.cluster.coordinator_process.pid

        def kill_once_in_flight() -> None:
            deadline = time.monotonic() + 60
            while not m.engine.has_unfinished_requests() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_in_flight, daemon=True)
        killer.start()
        long = SAMPLE.replace(num_tokens_to_generate=100)
        try:
            m.collect(iter([PROMPTS[0]] * 10_000), 64, n=GROUP, sampling_params=long)
        except (EngineLost, RuntimeError) as e:
            assert "coordinator process" in str(e) and "died" in str(e), e
            self.counts["coordinator_errors"] += 1
        else:
            raise AssertionError("collect returned after the coordinator was killed")
        killer.join(60)
        m.close()
        self.manager = self._new_manager()

    def main(self) -> None:
        emit("ready", pid=os.getpid())
        for fault in self.schedule:
            self.step(fault)
            emit("step", fault=fault, version=self.manager.version)
        self.manager.close()
        os.unlink(self.evil)
        emit("done", counts=self.counts, refusals=self.refusals, versions=sorted(self.versions))


class UnreadStreams:
    """`rollout serve`'s HTTP app on `m`'s coordinator (uvicorn in a thread, 2 s write-idle
    timeout, a 16-choice budget) and a stream of 16 choices, whose socket is never read, taking
    all of that budget."""

    def __init__(self, m: RolloutManager) -> None:
        cluster = m.engine.cluster
        app = build_app(cluster.address, auth_token=cluster.auth_token, tokenizer=self.tokenizer(),
                        limits=Limits(max_choices=16, max_inflight_choices=16, max_logprobs=20,
                                      max_request_tokens=100_000, max_inflight_tokens=100_000))  # fmt: skip
        self.sock = socket.socket()
        # accepted sockets inherit a small send buffer: the kernel holds little of an unread
        # answer, so uvicorn's writes pause within the short replies this engine allows
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        config = uvicorn_config(app, ConnectionLimits(write_idle_s=2.0), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})
        self.was_aborted = threading.Event()
        self.watch = _Signal(self.was_aborted, "aborted a connection whose caller read nothing")
        logging.getLogger("rollout.serving.http.server").addHandler(self.watch)

    @staticmethod
    def tokenizer():
        from rollout.tokenizers import ByteTokenizer

        return ByteTokenizer()

    def __enter__(self) -> UnreadStreams:
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the HTTP front end never started"
            time.sleep(0.05)
        body = json.dumps({"prompt": "a", "n": 16, "max_tokens": 100, "logprobs": 20,
                           "ignore_eos": True, "stream": True}).encode()  # fmt: skip
        self.stream = socket.socket()
        self.stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        self.stream.connect(self.sock.getsockname())
        self.stream.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                            b"Content-Type: application/json\r\n\r\n%s" % (len(body), body))  # fmt: skip
        return self

    def honest_admitted(self) -> int:
        """1 once another caller's request is answered 200 (429 while the stream's choices are
        still being generated: they hold the budget until the engines are done)."""
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=self.url, transport=transport, timeout=60) as http:
            deadline = time.monotonic() + 120
            while (r := http.post("/v1/completions", json={"prompt": "b", "max_tokens": 4})
                   ).status_code == 429:  # fmt: skip
                assert time.monotonic() < deadline, "the unread stream's budget never came back"
                time.sleep(0.1)
        assert r.status_code == 200, r.text
        return 1

    def aborted(self) -> int:
        """1 once the unread stream's connection was aborted, having sent no [DONE]."""
        assert self.was_aborted.wait(60), "the unread stream was never aborted"
        self.stream.settimeout(30)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := self.stream.recv(1 << 16):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b"[DONE]" not in data, data[-200:]
        return 1

    def __exit__(self, *exc) -> None:
        self.stream.close()
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()
        logging.getLogger("rollout.serving.http.server").removeHandler(self.watch)


class _Signal(logging.Handler):
    """Sets `event` when a record containing `text` is logged."""

    def __init__(self, event: threading.Event, text: str) -> None:
        super().__init__()
        self.event, self.text = event, text

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


if __name__ == "__main__":
    Trainer(sys.argv[1].split(","), float(sys.argv[2])).main()
