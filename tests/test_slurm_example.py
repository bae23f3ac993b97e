"""examples/slurm/grpo_multinode.sbatch on this one machine: `sbatch`, `srun` and `scontrol` are
small stand-ins (written here) that run every step locally, each node being 127.0.0.1, with the
SLURM_* variables the script and its tasks read. The script itself runs unchanged."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # .ci/run runs it; the default suite stays ~10 minutes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "slurm" / "grpo_multinode.sbatch"
# A couple of seconds of training: 2 groups x 4 samples, 2 RL steps, no eval, no W&B.
SHORT = [
    "trainer.steps=2", "trainer.warmup_sft_steps=2", "trainer.batch=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
    "recipe.eval_every=0", "logger=disabled",
]  # fmt: skip

# srun: the step's tasks run here, SIGTERM and SIGINT passed on to them, as srun does.
SRUN = """#!{python}
import os, signal, subprocess, sys

args, ntasks = sys.argv[1:], 1
while args and args[0].startswith("-"):
    option = args.pop(0)
    name, _, value = option.partition("=")
    if name not in ("--nodes", "--ntasks", "--ntasks-per-node", "--nodelist", "--exclude",
                    "--overlap", "--gpus-per-task", "--gpus") or (name != "--overlap" and not value):
        sys.exit(f"fake srun: unsupported option {{option!r}}")
    if name == "--ntasks":
        ntasks = int(value)
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(f"srun ntasks={{ntasks}} {{' '.join(args)}}\\n")
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
                                      "SLURM_NTASKS": str(ntasks)}}) for i in range(ntasks)]
signal.signal(signal.SIGTERM, lambda s, f: [t.send_signal(s) for t in tasks])
signal.signal(signal.SIGINT, lambda s, f: [t.send_signal(s) for t in tasks])
codes = [t.wait() for t in tasks]
sys.exit(next((abs(c) for c in codes if c), 0))
"""
# sbatch: runs the script at once (in the foreground) on --nodes "nodes", all 127.0.0.1.
SBATCH = """#!/bin/bash
nodes=1
while [[ $1 == -* ]]; do
  case $1 in
    --nodes=*) nodes=${1#*=} ;;
    *) echo "fake sbatch: unsupported option $1" >&2; exit 2 ;;
  esac
  shift
done
list=127.0.0.1
for ((i = 1; i < nodes; i++)); do list+=,127.0.0.1; done
export SLURM_JOB_NODELIST=$list SLURM_NNODES=$nodes SLURM_JOB_ID=4242 SLURM_SUBMIT_DIR=$PWD
exec bash "$@"
"""
SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] || { echo "fake scontrol: unsupported: $*" >&2; exit 2; }
tr , '\\n' <<<"$3"
"""


def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """Environment whose PATH finds the stand-ins first, then this interpreter's tools (python,
    rollout, torchrun); the run folder, the stand-ins' log and a free coordinator port."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("sbatch", SBATCH),
                       ("scontrol", SCONTROL)):  # fmt: skip
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**os.environ, "PATH": path, "PORT": str(port), "RUN_DIR": str(tmp_path / "job"),
           "FAKE_SLURM_LOG": str(tmp_path / "srun.log"), "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    env.pop("WANDB_API_KEY", None)
    return env


def run_job(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    job = Path(env["RUN_DIR"])
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(job.glob("*.log")))
    assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout[-3000:]}\n{out.stderr[-4000:]}{logs}"  # fmt: skip
    return out


def check_job(env: dict[str, str], out_dir: Path, engines: int, trainer: str = "python -m",
              steps: int = 2) -> dict:  # fmt: skip
    """The trainer (started as `trainer`) attached to serve's engine and `engines - 1` others,
    trained `steps` steps (weights pushed at attach and after each), and the service was
    stopped after it."""
    saved = json.loads((out_dir / "metrics.json").read_text())
    rows = [r for r in saved["history"] if "train/loss" in r]
    assert len(rows) == steps and saved["summary"]["final_version"] == steps + 1
    assert all(r["engine/num_engines"] == engines for r in rows), rows[-1]
    port = env["PORT"]
    assert saved["config"]["rollout"]["coordinator_address"] == f"tcp://127.0.0.1:{port}"
    assert saved["config"]["coordinator"]["weight_sync_host"] == "127.0.0.1"
    job = Path(env["RUN_DIR"])
    token = job / "auth_token"
    assert token.stat().st_mode & 0o077 == 0 and token.read_text().strip()
    serve = (job / "serve.log").read_text()
    assert "ready: 1 engine(s)" in serve and "rollout serve: stopped" in serve, serve
    ranks = sorted(int(line.split()[1]) for line in (job / "engines.log").read_text().splitlines()
                   if line.startswith("engine "))  # fmt: skip
    assert ranks == list(range(1, engines)), (job / "engines.log").read_text()
    steps_run = Path(env["FAKE_SLURM_LOG"]).read_text().splitlines()  # one srun per role
    roles = sorted(" ".join(s.split()[2:4]) for s in steps_run)
    assert roles == sorted(["bash -c", trainer, "rollout serve"]), steps_run
    return saved


def test_script_is_valid_bash():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.timeout(240)
def test_job_on_one_machine(tmp_path):
    """Two "nodes", two engines on the second: serve (coordinator + engine 0), one engine step
    of two tasks (ranks 1 and 2), a trainer of two torchrun ranks that ends with one set of
    weights; overrides through OVERRIDES and the arguments."""
    from test_torchrun import rank_digests

    env = fake_slurm(tmp_path)
    out_dir = tmp_path / "trainer"
    # a KL term: every step is taken (a step whose groups are all scored alike, which unseeded
    # sampling can make of every step, is otherwise skipped), so the ranks' DDP steps are checked
    env.update(OVERRIDES=" ".join(SHORT), ENGINES_PER_NODE="2", TRAINER_PROCS="2")
    moving = ["trainer.warmup_sft_steps=100", "trainer.warmup_sft_lr=0.003", "trainer.kl_coef=0.01"]
    out = run_job(["sbatch", "--nodes=2", str(SCRIPT), *moving, f"hydra.run.dir={out_dir}"], env)
    saved = check_job(env, out_dir, engines=3, trainer="torchrun --standalone")
    assert set(rank_digests(out.stdout, 2).values()) == {saved["summary"]["weights_sha256"]}
    assert not any(r["train/skipped_step"] for r in saved["history"] if "train/loss" in r)
    assert "ntasks=2 bash -c" in Path(env["FAKE_SLURM_LOG"]).read_text()


@pytest.mark.timeout(240)
def test_failed_trainer_stops_the_job(tmp_path):
    """A trainer that fails fails the job, and the service steps are stopped with it."""
    env = fake_slurm(tmp_path)
    argv = ["sbatch", "--nodes=2", str(SCRIPT), *SHORT, "rollout.prompts_per_step=0"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0 and "rollout.prompts_per_step" in out.stderr, out.stderr[-3000:]
    job = Path(env["RUN_DIR"])
    assert "rollout serve: stopped" in (job / "serve.log").read_text()
    assert "ntasks=1 bash -c" in Path(env["FAKE_SLURM_LOG"]).read_text()  # the engines' step ran
