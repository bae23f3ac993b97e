"""README: "Several machines": serve, a remote engine, an attached trainer; the SLURM example and
torchrun trainer ranks."""

from __future__ import annotations

import asyncio
import re

import pytest
from readme_helpers import (
    SHORT,
    Proc,
    argv_of,
    peer_token,
    readme_command,
    run,
    run_recipe,
    serve_requests,
    train_rows,
)


@pytest.mark.timeout(180)
@pytest.mark.heavy  # >10 s of real processes: out of the ~10-minute default suite
def test_serve_with_remote_engine(tmp_path):
    """The "Several machines" walkthrough on one machine: serve, then an engine joins from
    another process with the shared secret; requests are served by both; the trainer attaches
    to both and trains (its weights pushed to them); the service outlives it; SIGTERM stops
    everything."""
    secret = tmp_path / "secret"
    secret.write_text("readme-secret\n")
    secret.chmod(0o600)
    # The row's secret placeholder names the token file (or the value of an environment variable).
    subs = {"S": str(secret), "FILE": str(secret), "R": "1", "DIR": "tiny"}
    serve_argv, env = argv_of(readme_command("test_serve_with_remote_engine", "serve"), **subs)
    with Proc(serve_argv, env) as serve:
        address = serve.read_until(r"coordinator (tcp://\S+) pid")[1]
        serve.read_until(r"^ready")
        token = peer_token(serve, serve_argv, env)
        printed = [m for line in serve.seen if (m := re.match(r"auth token file (\S+)", line))]
        if printed:  # FILE in the engine's row: a copy of the file serve printed
            subs["FILE"] = printed[0][1]
        host_port = address.removeprefix("tcp://").replace("0.0.0.0", "127.0.0.1")
        engine_argv, env = argv_of(readme_command("test_serve_with_remote_engine", "engine"),
                                   **{"HOST:PORT": host_port, **subs})  # fmt: skip
        with Proc(engine_argv, env) as engine:
            engine.read_until(r"engine 1 pid \d+ -> tcp://")
            assert asyncio.run(serve_requests(f"tcp://{host_port}", token, engines=2)) == 24
            # the trainer attaches to both engines and trains through them
            trainer = readme_command("test_serve_with_remote_engine", "python -m recipes")
            saved = run_recipe(trainer, tmp_path / "trainer",
                               **{"HOST:PORT": host_port, "TRAINER_ADDR": "127.0.0.1", **subs})  # fmt: skip
            assert len(train_rows(saved)) == 2 and saved["summary"]["final_version"] == 3
            assert saved["config"]["rollout"]["coordinator_address"] == f"tcp://{host_port}"
            assert asyncio.run(serve_requests(f"tcp://{host_port}", token, engines=2)) == 24
            assert serve.stop() == 0
            assert engine.p.wait(60) == 0, "the remote engine exits when its coordinator stops"


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_slurm_example(tmp_path):
    """The SLURM example through stand-in sbatch/srun/scontrol (tests/test_slurm_example.py,
    which runs the script in the default suite): 3 "nodes" on this machine, serve's engine and
    one engine on each other node, the trainer attached to all three."""
    from test_slurm_example import check_job, fake_slurm, run_job

    argv, env = argv_of(readme_command("test_slurm_example"))
    env.update(fake_slurm(tmp_path))
    run_job([*argv, *SHORT, f"hydra.run.dir={tmp_path / 'trainer'}"], env)
    check_job(env, tmp_path / "trainer", engines=3)


@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_torchrun_trainer(tmp_path):
    """Two trainer ranks (tests/test_torchrun.py runs the same in the default suite): rank 0
    generates, logs and pushes; both end with the weights it pushed."""
    from test_torchrun import check_recipe_run

    argv, env = argv_of(readme_command("test_torchrun_trainer"))
    out = run([*argv, *SHORT, f"hydra.run.dir={tmp_path}"], env)
    check_recipe_run(out.stdout, tmp_path, steps=2)
