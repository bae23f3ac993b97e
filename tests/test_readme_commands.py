"""Every command README.md documents, run as written: a README line no test runs can rot.

`test_every_readme_command_is_covered` parses the README (```bash blocks, inline commands, and
the overrides in the "Growing from the embedded default" table) and fails on any command that
`COVERED` does not map to a test here. Each test takes its command text from the README itself,
fills in placeholders (a checkpoint path, an address), and appends short-run Hydra overrides
(later overrides win), so it runs the documented command, not a paraphrase. The README's
```python blocks are executed too, with only the names their prose leaves to the reader (your
policy, your loss) predefined.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from rollout.config import ConfigError, compose, validate
from rollout.engine.config import InferenceConfig
from rollout.metrics import NAMESPACES
from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
GROWING_HEADING = "### Growing from the embedded default"
COMMAND_WORDS = ("bash ", "python ", "pytest ", "rollout ", "torchrun", "pip ")
# A couple of seconds of work per recipe run: 2 groups x 4 samples, 2 RL steps, no eval.
SHORT = [
    "trainer.steps=2", "trainer.warmup_sft_steps=2", "trainer.batch=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
    "recipe.eval_every=0", "logger=disabled",
]  # fmt: skip

# README command -> the test in this module that runs it.
COVERED = {
    "bash scripts/main.sh": "test_main_sh_runs_the_main_job",
    "bash scripts/main.sh trainer.steps=100 rollout.samples_per_prompt=4": "test_main_sh_runs_the_main_job",
    "bash scripts/test.sh": "test_test_sh_runs_pytest",
    "python -m pytest -q": "test_test_sh_runs_pytest",
    "python -m recipes.grpo_reverse": "test_main_job_recipe",
    "python -m recipes.grpo_reverse_async": "test_async_recipe",
    "python -m recipes.grpo_calculator": "test_calculator_recipe",
    "python -m recipes.grpo_reverse -m trainer.lr=1e-3,2e-3": "test_multirun",
    "pytest -m slow tests/test_recipes.py": "test_slow_recipe_selection",
    "rollout.dp=2": "test_more_engines",
    "model=hf_dir model.path=/ckpt/Qwen2.5-0.5B-Instruct": "test_hf_dir_checkpoint",
    "engine=gpu": "test_engine_gpu",
    "rollout serve --model DIR|tiny --dp N [--port P] [--policy NAME]": "test_serve_synopsis",
    "rollout serve --model DIR --host 0.0.0.0": "test_serve_with_remote_engine",
    "rollout serve --model DIR --batch-invariant": "test_serve_batch_invariant",
    "rollout engine --coordinator tcp://HOST:PORT --rank R --model DIR --auth-token-file FILE": "test_serve_with_remote_engine",
    "python -m recipes.grpo_reverse rollout.coordinator_address=tcp://HOST:PORT rollout.dp=2 coordinator.token_file=FILE coordinator.weight_sync_host=TRAINER_ADDR": "test_serve_with_remote_engine",
    "python -m recipes.grpo_reverse -m hydra/launcher=submitit_slurm trainer.lr=1e-3,3e-3": "test_slurm_sweep_row",
    "ROLLOUT_HTTP_TOKEN=secret rollout serve --model DIR --http-port 8000": "test_http_section",
    """curl -s http://127.0.0.1:8000/v1/completions -H "Authorization: Bearer secret" -H "Content-Type: application/json" -d '{"model": "DIR", "prompt": "Hello", "max_tokens": 8, "seed": 0, "logprobs": 1}'""": "test_http_section",
    "rollout serve --model DIR --http-port 8000": "test_rl_frameworks_section",
    "sbatch --nodes=3 examples/slurm/grpo_multinode.sbatch trainer.steps=100": "test_slurm_example",
    "torchrun --standalone --nproc_per_node=2 -m recipes.grpo_reverse": "test_torchrun_trainer",
    "python -m recipes.grpo_reverse rollout.launcher=ray rollout.dp=2": "test_ray_launcher_recipe",
    "rollout serve --model DIR --dp 2 --launcher ray": "test_serve_launcher_ray",
    "python -m recipes.grpo_reverse rollout.batch_invariant=true": "test_batch_invariant_recipe",
}  # fmt: skip
# README ```python blocks (by the heading above them) -> the test that executes them.
SNIPPETS = {
    "### As a trainer's rollout layer": "test_trainer_snippet",
    "### Multi-turn, tool-using episodes": "test_episode_snippet",
    "### As an inference library": "test_inference_snippet",
    "### LoRA: push the adapter, not the merged model": "test_lora_snippet",
    "### OpenAI-compatible HTTP": "test_http_section",
    "### TRL's GRPOTrainer": "test_trl_snippet",
    "### Routing replay for MoE models (R3)": "test_routing_replay_snippet",
    "### Batch-invariant mode": "test_batch_invariant_snippet",
    "#### Replaying a rollout bit for bit": "test_replay_snippet",
    "#### In the trainer": "test_batch_invariant_trainer_snippet",
}
# README commands no test runs, each with the reason; keep this short.
NOT_RUN = {
    "bash scripts/test_frameworks.sh": ".ci/run runs it last (installs the frameworks, ~20 min)",
    "pip install hydra-submitit-launcher": "installs a package from the network",
    "rollout serve": "the command's name in prose; its synopsis and real runs are covered above",
    "rollout engine": "the command's name in prose; its real run is covered above",
    "bash scripts/fetch_gpu_wheels.sh": "downloads wheels from the network",
    "pip install -e '.[skyrl]'": "installs packages from the network (tests/clients/test_skyrl.py)",
    "pip install --no-deps areal==1.0.4 colorlog tenacity flask torchdata lark uvloop ray numba llvmlite orjson einops aiofiles blinker itsdangerous werkzeug": "installs packages from the network (tests/clients/test_areal.py)",
    "bash scripts/gpu_check.sh": "runs on the GPU machine; its CPU mode is tests/test_gpu_check.py",
    "python scripts/gpu_check.py --device cpu": "tests/test_gpu_check.py runs it (~30 s; not twice)",
    "ray start --head --port=6379": "Ray's own CLI (daemons); tests/test_ray_launcher.py builds "
    "the same head and workers with ray.cluster_utils.Cluster",
    "ray start --address=HEAD:6379": "Ray's own CLI (as above)",
}


def readme_commands(text: str) -> list[str]:
    """Commands in `text`: lines of ```bash blocks, inline spans that start with a command word,
    and the Hydra overrides in the "Growing from the embedded default" table."""
    found: list[str] = []
    fence: str | None = None
    in_growing = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:]
            continue
        if fence is not None:
            if fence == "bash" and stripped and not stripped.startswith("#"):
                found.append(stripped)
            continue
        if line.startswith("#"):
            in_growing = line.strip() == GROWING_HEADING
        for span in re.findall(r"`([^`]+)`", line):
            span = span.strip()
            override = in_growing and line.startswith("|") and re.match(r"[\w.+~/]+=\S", span)
            if span.startswith(COMMAND_WORDS) or override:
                found.append(span)
    return list(dict.fromkeys(found))


def python_snippets(text: str) -> dict[str, str]:
    """The ```python blocks of `text`, keyed by the nearest heading above each."""
    blocks: dict[str, str] = {}
    heading, code = "", None
    for line in text.splitlines():
        if code is None and line.startswith("#"):
            heading = line.strip()
        elif code is None and line.strip() == "```python":
            code = []
        elif code is not None and line.strip() == "```":
            blocks[heading] = "\n".join(code) + "\n"
            code = None
        elif code is not None:
            code.append(line)
    return blocks


def readme_command(test_name: str, contains: str = "") -> str:
    """The README command that `COVERED` gives to `test_name`: the one equal to `contains`, else
    the one containing it."""
    cmds = [c for c, t in COVERED.items() if t == test_name and contains in c]
    cmds = [contains] if contains in cmds else cmds
    assert len(cmds) == 1, (test_name, contains, cmds)
    assert cmds[0] in readme_commands(README), f"{cmds[0]!r} is no longer in README.md"
    return cmds[0]


def argv_of(command: str, **placeholders: str) -> tuple[list[str], dict[str, str]]:
    """(argv, env) for a README command: placeholders replaced, leading NAME=value words as
    environment, `python`/`rollout`/`pytest` resolved in this interpreter's environment.
    A bare override line ("rollout.dp=2") runs the main job with it."""
    for key, value in placeholders.items():  # whole placeholders only: R is not the R of DIR
        command = re.sub(rf"(?<![A-Za-z0-9_]){re.escape(key)}(?![A-Za-z0-9_])", value, command)
    words = shlex.split(command)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[0] not in ("bash", "python", "pytest", "rollout", "torchrun", "sbatch"):
        words = ["python", "-m", "recipes.grpo_reverse", *words]
    bindir = Path(sys.executable).parent
    head = {
        "python": [sys.executable],
        "pytest": [sys.executable, "-m", "pytest"],
        "rollout": [str(bindir / "rollout")],
        "bash": ["bash"],
        "torchrun": [str(bindir / "torchrun")],
        "sbatch": ["sbatch"],  # from PATH: tests/test_slurm_example.py's stand-in
    }[words[0]]
    return [*head, *words[1:]], env


def run(argv: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    out = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def run_recipe(command: str, out_dir: Path, *extra: str, **placeholders: str) -> dict:
    """Run a recipe command with SHORT overrides into `out_dir`; returns its metrics.json."""
    argv, env = argv_of(command, **placeholders)
    run([*argv, *SHORT, *extra, f"hydra.run.dir={out_dir}"], env)
    return json.loads((out_dir / "metrics.json").read_text())


def train_rows(saved: dict) -> list[dict]:
    return [r for r in saved["history"] if "train/loss" in r]


# -- the README itself -----------------------------------------------------------------------------


def test_every_readme_command_is_covered():
    commands = readme_commands(README)
    assert "bash scripts/main.sh" in commands and "engine=gpu" in commands  # the parser works
    missing = [c for c in commands if c not in COVERED and c not in NOT_RUN]
    assert not missing, f"README commands no test runs (add them to COVERED): {missing}"
    stale = [c for c in [*COVERED, *NOT_RUN] if c not in commands]
    assert not stale, f"COVERED/NOT_RUN entries no longer in README.md: {stale}"
    tests = {name for name, obj in globals().items() if name.startswith("test_") and callable(obj)}
    assert set(COVERED.values()) <= tests, set(COVERED.values()) - tests
    snippets = python_snippets(README)
    assert set(snippets) == set(SNIPPETS), f"README python blocks vs SNIPPETS: {sorted(snippets)}"
    assert set(SNIPPETS.values()) <= tests


def test_readme_lists_the_metric_namespaces():
    """The README's namespace list is `rollout.metrics.NAMESPACES`, no more, no less."""
    m = re.search(r"logs to W&B under (.*?)`rollout\.metrics\.NAMESPACES`", README, re.S)
    assert m, "README.md no longer lists the namespaces the recipe logs under"
    assert set(re.findall(r"`(\w+)/\*`", m.group(1))) == set(NAMESPACES)


# -- the main job ----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_main_job_recipe(tmp_path):
    saved = run_recipe(readme_command("test_main_job_recipe"), tmp_path / "run")
    assert saved["summary"]["mode"] == "colocated" and saved["summary"]["steps"] == 2
    assert len(train_rows(saved)) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_recipe(tmp_path):
    saved = run_recipe(readme_command("test_async_recipe"), tmp_path / "run")
    assert saved["summary"]["mode"] == "async" and len(train_rows(saved)) == 2


@pytest.mark.timeout(300)
def test_calculator_recipe(tmp_path):
    saved = run_recipe(readme_command("test_calculator_recipe"), tmp_path / "run")
    rows = train_rows(saved)
    assert saved["summary"]["recipe"] == "grpo_calculator" and len(rows) == 2
    assert all("rollout/turns_per_episode" in r and "rollout/tool_calls" in r for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multirun(tmp_path):
    argv, env = argv_of(readme_command("test_multirun"))
    run([*argv, *SHORT, f"hydra.sweep.dir={tmp_path}"], env)
    lrs = [json.loads((tmp_path / j / "metrics.json").read_text())["config"]["trainer"]["lr"]
           for j in ("0", "1")]  # fmt: skip
    assert lrs == [1e-3, 2e-3]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_main_sh_runs_the_main_job(tmp_path):
    """Installs into .venv (scripts/setup_env.sh) like a fresh machine, then runs the recipe."""
    for i, command in enumerate(
        c for c, t in COVERED.items() if t == "test_main_sh_runs_the_main_job"
    ):
        argv, env = argv_of(readme_command("test_main_sh_runs_the_main_job", command))
        out_dir = tmp_path / str(i)
        run([*argv, *SHORT, f"hydra.run.dir={out_dir}"], env, timeout=540)
        saved = json.loads((out_dir / "metrics.json").read_text())
        assert saved["summary"]["steps"] == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_test_sh_runs_pytest():
    """scripts/test.sh is `python -m pytest -q` after setup; both run here on one small file."""
    for command in ("bash scripts/test.sh", "python -m pytest -q"):
        argv, env = argv_of(readme_command("test_test_sh_runs_pytest", command))
        out = run([*argv, "-p", "no:cacheprovider", "tests/test_hashing.py"], env, timeout=540)
        assert re.search(r"\d+ passed", out.stdout), out.stdout[-2000:]


@pytest.mark.slow
def test_slow_recipe_selection():
    """`pytest -m slow tests/test_recipes.py` selects the learning run (collected, not run)."""
    argv, env = argv_of(readme_command("test_slow_recipe_selection"))
    out = run([*argv, "--collect-only", "-q", "-p", "no:cacheprovider"], env, timeout=120)
    assert "test_rl_beats_the_warm_start" in out.stdout, out.stdout[-2000:]


# -- growing from the embedded default -------------------------------------------------------------


@pytest.mark.timeout(300)
def test_more_engines(tmp_path):
    """dp engine processes behind the coordinator; coordinator counters are logged too."""
    command = readme_command("test_more_engines")
    dp = int(command.partition("=")[2])
    saved = run_recipe(command, tmp_path / "run")
    rows = train_rows(saved)
    assert len(rows) == 2 and saved["summary"]["final_version"] == 2
    assert all(r["engine/num_engines"] == dp for r in rows)
    assert all(r["coordinator/requests"] >= 8 for r in rows), rows[-1]


def make_checkpoint(path: Path, architecture: str, bos: bool) -> Path:
    """A tiny random checkpoint in HF layout with a byte-level BPE tokenizer.json. Without `bos`
    it is shaped like Qwen2.5's files: no bos token, eos <|im_end|>, pad <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rollout.models import ModelConfig, build_model, save_pretrained

    specials = ["<unk>", "<s>", "</s>"] if bos else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["0123456789>+=", "123>321", "12+34=46"], trainer)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    names = ({"bos_token": "<s>", "eos_token": "</s>"} if bos else
             {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(names))
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = ModelConfig.preset("tiny", vocab_size=tok.get_vocab_size(), architecture=architecture,
                                **(moe if architecture.endswith("_moe") else {}))  # fmt: skip
    save_pretrained(build_model(config, seed=0), config, path)
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "architecture, bos",
    [("qwen2", False), pytest.param("llama", True, marks=pytest.mark.slow),
     pytest.param("qwen3_moe", False, marks=pytest.mark.slow)],
)  # fmt: skip
def test_hf_dir_checkpoint(tmp_path, architecture, bos):
    """A saved Llama / Qwen2 / Qwen3-MoE folder through the recipe; Qwen's tokenizers have no
    bos token."""
    from recipes.config import task_of
    from rollout.tokenizers import load_tokenizer

    ckpt = make_checkpoint(tmp_path / architecture, architecture, bos)
    tok = load_tokenizer(ckpt)
    assert (tok.bos_id is not None) == bos
    command = readme_command("test_hf_dir_checkpoint")
    placeholder = {"/ckpt/Qwen2.5-0.5B-Instruct": str(ckpt)}
    task = task_of(validate(compose(argv_of(command, **placeholder)[0][3:])))
    example = task.make_example(random.Random(0))
    bos_prefix = [tok.bos_id] if bos else []
    assert task.prompt_ids(example, tok) == [*bos_prefix, *tok.encode(example.prompt)]
    saved = run_recipe(command, tmp_path / "run", **placeholder)
    assert saved["config"]["model"]["path"] == str(ckpt)
    assert len(train_rows(saved)) == 2 and saved["summary"]["final_version"] == 2


def test_engine_gpu(tmp_path):
    """engine=gpu asks for CUDA (bf16): without CUDA it is a config error before any work."""
    overrides = shlex.split(readme_command("test_engine_gpu"))
    cfg = compose(overrides)
    assert cfg.model.device == "cuda" and cfg.model.dtype.name == "bfloat16"
    if torch.cuda.is_available():
        assert str(validate(cfg).model.device) == "cuda"
        return
    with pytest.raises(ConfigError, match=r"model\.device='cuda'.*CUDA is not available"):
        validate(cfg)
    argv, env = argv_of(readme_command("test_engine_gpu"))
    out = subprocess.run([*argv, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "CUDA is not available" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_sweep_row(tmp_path):
    """The SLURM row's sweep through submitit's local executor (no SLURM here)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    command = readme_command("test_slurm_sweep_row")
    argv, env = argv_of(command, **{"submitit_slurm": "submitit_local"})
    run([*argv, *SHORT, f"hydra.sweep.dir={tmp_path}"], env)
    assert len(list(tmp_path.glob("*/metrics.json"))) == 2


# -- rollout serve / rollout engine ----------------------------------------------------------------


class Proc:
    """A CLI process whose stdout is read line by line, killed on exit if still running."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.seen: list[str] = []

    def read_until(self, pattern: str) -> re.Match:
        """Lines until one matches; fails when the process closes stdout (pytest-timeout bounds
        a process that prints nothing)."""
        for line in self.p.stdout:
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"{shlex.join(self.argv)}: no {pattern!r} in\n{''.join(self.seen)}")

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(60)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def peer_token(serve: Proc, argv: list[str], env: dict[str, str]) -> str | None:
    """The secret a client must present to this `rollout serve`: the file it was given
    (--auth-token-file), the environment's, or the one it generated and printed."""
    for flag in ("--auth-token-file", "--auth-token"):
        if flag in argv:
            return Path(argv[argv.index(flag) + 1]).read_text().strip()
    if env.get("ROLLOUT_AUTH_TOKEN"):
        return env["ROLLOUT_AUTH_TOKEN"]
    if env.get("ROLLOUT_AUTH_TOKEN_FILE"):
        return Path(env["ROLLOUT_AUTH_TOKEN_FILE"]).read_text().strip()
    printed = [m for line in serve.seen if (m := re.match(r"auth token file (\S+)", line))]
    return Path(printed[0][1]).read_text().strip() if printed else None


async def serve_requests(address: str, token: str | None, engines: int) -> int:
    """Wait for `engines` registered engines, then generate 8 x 3 tokens; returns tokens made."""
    client = await InferenceClient(address, auth_token=token).start()
    try:
        while len((await client.stats())["engines"]) < engines:
            await asyncio.sleep(0.05)  # the coordinator's own view; pytest-timeout bounds it
        sp = SamplingParams(temperature=0.0, num_tokens_to_generate=3)
        recs = await asyncio.gather(*[client.add_request([i + 1] * 5, sp) for i in range(8)])
        return sum(len(r.merge().generated_tokens) for r in recs)
    finally:
        client.stop()


@pytest.mark.timeout(180)
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_trainer(tmp_path):
    """Two trainer ranks (tests/test_torchrun.py runs the same in the default suite): rank 0
    generates, logs and pushes; both end with the weights it pushed."""
    from test_torchrun import check_recipe_run

    argv, env = argv_of(readme_command("test_torchrun_trainer"))
    out = run([*argv, *SHORT, f"hydra.run.dir={tmp_path}"], env)
    check_recipe_run(out.stdout, tmp_path, steps=2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_synopsis():
    """`rollout serve --model tiny --dp 2 --port P --policy NAME` serves an InferenceClient."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    command = readme_command("test_serve_synopsis").replace("[", "").replace("]", "")
    argv, env = argv_of(
        command, **{"DIR|tiny": "tiny", "N": "2", "P": port, "NAME": "longest_prefix"}
    )
    with Proc(argv, env) as serve:
        address = serve.read_until(r"coordinator (tcp://\S+) pid")[1]
        assert address.endswith(f":{port}")
        serve.read_until(r"^ready: 2 engine")
        token = peer_token(serve, argv, env)
        assert asyncio.run(serve_requests(address, token, engines=2)) == 24
        assert serve.stop() == 0


@pytest.mark.timeout(300)
def test_serve_batch_invariant():
    """`rollout serve --model tiny --batch-invariant`: a prompt's log-probs are the same bits
    alone and inside a crowd of other prompts on the served engine."""
    argv, env = argv_of(readme_command("test_serve_batch_invariant"), DIR="tiny")
    with Proc(argv, env) as serve:
        address = serve.read_until(r"coordinator (tcp://\S+) pid")[1]
        serve.read_until(r"^ready: 1 engine")
        token = peer_token(serve, argv, env)

        async def needle() -> tuple[list[float], list[float]]:
            client = await InferenceClient(address, auth_token=token).start()
            try:
                sp = SamplingParams(temperature=0.0, num_tokens_to_generate=5,
                                    return_log_probs=True, ignore_eos=True)  # fmt: skip
                prompt = [3, 1, 4, 1, 5, 9, 2]
                alone = (await client.add_request(prompt, sp)).merge()
                crowd = [[i + 7] * (3 + 5 * i) for i in range(6)]
                crowd.insert(4, prompt)
                recs = await asyncio.gather(*[client.add_request(p, sp) for p in crowd])
                return alone.generated_log_probs, recs[4].merge().generated_log_probs
            finally:
                client.stop()

        alone, in_crowd = asyncio.run(needle())
        assert len(alone) == 5 and alone == in_crowd


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


def test_http_section():
    """The HTTP section as written: serve with --http-port, the curl line, the openai block
    (DIR -> tiny, port 8000 -> a free one)."""
    serve_cmd = readme_command("test_http_section", "rollout serve")
    argv, env = argv_of(serve_cmd, DIR="tiny", **{"8000": "0"})
    with Proc(argv, env) as serve:
        url = serve.read_until(r"^http (http://\S+)")[1]
        port = url.rsplit(":", 1)[1]
        curl = shlex.split(readme_command("test_http_section", "curl").replace("8000", port)
                           .replace('"DIR"', '"tiny"'))  # fmt: skip
        body = json.loads(run(curl, env).stdout)
        choice = body["choices"][0]
        assert len(choice["token_ids"]) == 8 and choice["weight_versions"] == [0] * 8
        assert choice["logprobs"]["token_logprobs"] == choice["token_logprobs"]
        ns = exec_snippet("### OpenAI-compatible HTTP", {},
                          **{"8000": port, '"DIR"': '"tiny"'})  # fmt: skip
        assert ns["choice"].token_ids == choice["token_ids"]  # same seed, same tokens
        assert serve.stop() == 0


RL_FRAMEWORKS = "### RL frameworks on `rollout serve`: SkyRL, AReaL, prime-rl, slime"


def section_text_blocks(heading: str) -> list[str]:
    """The ```text blocks of the README section under `heading` (up to the next ### heading)."""
    section = README.split(heading, 1)[1].split("\n### ", 1)[0]
    return [b.strip() for b in re.findall(r"```text\n(.*?)```", section, re.S)]


@pytest.mark.timeout(300)
def test_rl_frameworks_section():
    """The RL frameworks section as written: the serve line, then each framework's config line
    (HOST:8000 -> the server) drives that framework's first calls."""
    serve_cmd = readme_command("test_rl_frameworks_section", "rollout serve")
    argv, env = argv_of(serve_cmd, DIR="tiny", **{"8000": "0"})
    skyrl, areal, prime, slime = section_text_blocks(RL_FRAMEWORKS)
    with Proc(argv, env) as serve:
        url = serve.read_until(r"^http (http://\S+)")[1]
        hostport = url.removeprefix("http://")
        with httpx.Client(timeout=60) as h:
            # SkyRL: the data plane at external_proxy_url, the control plane at each server url
            skyrl = skyrl.replace("HOST:8000", hostport)
            proxy = re.search(r"external_proxy_url=(\S+)", skyrl)[1]
            servers = re.search(r"external_server_urls=\[(\S+)\]", skyrl)[1].split(",")
            assert "run_engines_locally=false" in skyrl
            assert h.get(f"{servers[0]}/get_world_size").json() == {"world_size": 1}
            gen = h.post(f"{proxy}/inference/v1/generate", json={
                "token_ids": [1, 2], "cache_salt": "0",
                "sampling_params": {"max_tokens": 3, "logprobs": 0}}).json()  # fmt: skip
            assert gen["choices"][0]["weight_versions"] == [0] * 3
            # AReaL: the env var names host:port; its vLLM backend's generation request
            addr = re.fullmatch(
                r"AREAL_LLM_SERVER_ADDRS=(\S+)", areal.replace("HOST:8000", hostport)
            )[1]
            out = h.post(f"http://{addr}/v1/completions", json={
                "prompt": [1, 2], "max_tokens": 3, "return_tokens_as_token_ids": True,
                "logprobs": 0, "skip_special_tokens": True}).json()  # fmt: skip
            assert [t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"]] == [
                True
            ] * 3
            # prime-rl: admin routes at base_url without /v1
            base = re.search(r'base_url=\["(\S+?)"\]', prime.replace("HOST:8000", hostport))[1]
            admin = base.removesuffix("/v1")
            assert (
                h.post(
                    f"{admin}/pause", params={"mode": "keep", "clear_cache": "false"}
                ).status_code
                == 200
            )
            assert h.post(f"{admin}/resume").status_code == 200
            # slime: the external engine's start-up probes
            engine = re.fullmatch(r"--rollout-external-engine-addrs (\S+)",
                                  slime.replace("HOST:8000", hostport))[1]  # fmt: skip
            assert h.get(f"http://{engine}/health_generate").status_code == 200
            assert h.get(f"http://{engine}/get_server_info").json()["dp_size"] == 1
        assert serve.stop() == 0


# -- the README's python blocks --------------------------------------------------------------------


def exec_snippet(heading: str, names: dict, **placeholders: str) -> dict:
    """Execute the README block under `heading` with `names` (what the prose leaves to the
    reader: your policy, your loss) predefined; returns its namespace."""
    code = python_snippets(README)[heading]
    for key, value in placeholders.items():
        code = code.replace(key, value)
    namespace = dict(names)
    exec(compile(code, f"README.md: {heading}", "exec"), namespace)
    return namespace


def test_batch_invariant_snippet():
    """The batch-invariant block as written: its own assert is the check; the dense forward
    of the same model then scores the generated tokens with the same bits."""
    from rollout.models import batch_invariant as bi

    ns = exec_snippet("### Batch-invariant mode", {})
    alone = ns["alone"]
    tokens = torch.tensor([[1, 2, 3, *alone.generated_tokens]])
    with torch.no_grad():
        logits = ns["model"](tokens)  # the engine set model.batch_invariant
    lp = bi.token_log_probs(logits[0, 2:-1], tokens[0, 3:])
    assert torch.equal(lp, torch.tensor(alone.generated_log_probs, dtype=torch.float32))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_snippet():
    """The trainer loop: an embedded engine, 2 steps of 16 groups x 8 samples, weights synced."""
    import copy
    import itertools

    from rollout import InferenceConfig
    from rollout.models import ModelConfig, build_model
    from rollout.rl.samples import collate
    from rollout.tokenizers import ByteTokenizer
    from trainer_hooks.losses import sequence_log_probs

    tok = ByteTokenizer()
    policy = build_model(ModelConfig.preset("tiny", vocab_size=tok.vocab_size), seed=0)

    def grpo_loss(model, groups):
        batch = collate(groups, tok.pad_id)
        mask = batch["completion_mask"]
        return -sequence_log_probs(model(batch["tokens"]), batch["tokens"], mask).sum() / mask.sum()

    names = dict(
        policy=policy, policy_copy=copy.deepcopy(policy), tok=tok, steps=2, grpo_loss=grpo_loss,
        icfg=InferenceConfig(max_sequence_length=64), reward=lambda s: float(len(s.completion_tokens) % 2),
        dataset=itertools.cycle(["12>", "345>", "6789>"]),
        opt=torch.optim.SGD(policy.parameters(), lr=1e-3),
    )  # fmt: skip
    ns = exec_snippet("### As a trainer's rollout layer", names)
    groups, manager = ns["groups"], ns["manager"]
    try:
        assert len(groups) == 16 * 8 and all(
            len(s.logprobs) == len(s.completion_tokens) for s in groups
        )
        assert manager.version == 2
    finally:
        manager.close()


@pytest.mark.timeout(120)
def test_replay_snippet():
    """The replay block: a sample that spans versions 0 and 1 of a manager in batch-invariant
    mode replays exactly, and its trace scores to its own log-probs."""
    from rollout.models import ModelConfig, build_model
    from rollout.rl.manager import RolloutManager

    cfg = ModelConfig.preset("tiny", vocab_size=128)
    model = build_model(cfg, seed=0)
    weights_v0 = {k: v.clone() for k, v in model.state_dict().items()}
    weights_v1 = build_model(cfg, seed=1).state_dict()
    inference_config = InferenceConfig(num_blocks=64, block_size=8, batch_invariant=True)
    sp = SamplingParams(num_tokens_to_generate=12, ignore_eos=True)
    prompts = [{"prompt": [5, 6, 7], "sampling_params": sp.replace(num_tokens_to_generate=n)}
               for n in (2, 12)]  # fmt: skip
    with RolloutManager(model=model, inference_config=inference_config, max_inflight_groups=2,
                        suspend_mode="offload") as m:  # fmt: skip
        source = iter(prompts)
        m.collect(source, 1, n=1)
        m.suspend()
        m.update_weights(weights_v1)
        m.resume()
        (sample,) = m.collect(source, 1, n=1)
    assert sample.weight_versions == [0, 1]
    tokens = sample.completion_tokens[: sample.token_versions.count(0)]
    ns = exec_snippet("#### Replaying a rollout bit for bit", dict(
        sample=sample, model=model, tokenizer=None, weights_v0=weights_v0, weights_v1=weights_v1,
        inference_config=inference_config, tokens=tokens))  # fmt: skip
    assert ns["r"].tokens == sample.completion_tokens
    assert ns["lp"] == sample.logprobs[: len(tokens)]


def test_routing_replay_snippet():
    """The routing-replay block on a tiny Qwen3-MoE: samples from a manager that records."""
    transformers = pytest.importorskip("transformers")
    from rollout.models import from_transformers
    from rollout.rl.manager import RolloutManager, RolloutManagerConfig
    from rollout.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.vocab_size, hidden_size=32,
                                      intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=16)  # fmt: skip
    hf_model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    model, _ = from_transformers(hf_model)
    sp = SamplingParams(num_tokens_to_generate=4)
    with RolloutManager(RolloutManagerConfig(routing_replay=True), model=model, tokenizer=tok) as m:
        samples = m.generate(["ab", "cde"], n=2, sampling_params=sp)
    ns = exec_snippet("### Routing replay for MoE models (R3)", dict(samples=samples,
                                                                       hf_model=hf_model))  # fmt: skip
    assert ns["batch"]["routed_experts"].shape[2:] == (2, 2)
    assert ns["logits"].shape[:2] == ns["batch"]["tokens"].shape


@pytest.mark.timeout(120)
def test_batch_invariant_trainer_snippet():
    """The trainer block on a tiny Qwen3: samples from a batch-invariant manager."""
    transformers = pytest.importorskip("transformers")
    from rollout import InferenceConfig
    from rollout.models import from_transformers
    from rollout.rl.manager import RolloutManager, RolloutManagerConfig
    from rollout.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    cfg = transformers.Qwen3Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)  # fmt: skip
    hf_model = transformers.Qwen3ForCausalLM(cfg)
    model, _ = from_transformers(hf_model)
    sp = SamplingParams(num_tokens_to_generate=4, temperature=0.7)
    icfg = InferenceConfig(batch_invariant=True)
    with RolloutManager(RolloutManagerConfig(logprobs_mode="processed"), model=model,
                        tokenizer=tok, inference_config=icfg) as m:  # fmt: skip
        samples = m.generate(["ab", "cde"], n=2, sampling_params=sp)
    ns = exec_snippet("#### In the trainer", dict(samples=samples, hf_model=hf_model, t=0.7))
    assert ns["new_logp"].requires_grad


@pytest.mark.timeout(300)
def test_batch_invariant_recipe(tmp_path):
    saved = run_recipe(readme_command("test_batch_invariant_recipe"), tmp_path / "run")
    rows = train_rows(saved)
    assert len(rows) == 2 and all(r["mismatch/logprob_abs_diff_max"] == 0.0 for r in rows)


@pytest.mark.clients
@pytest.mark.timeout(300)
def test_trl_snippet(tmp_path):
    """The TRL block: 2 GRPO steps on a tiny checkpoint, weights pushed after each."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    import datasets
    import trl
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "examples"))
    from trl_grpo import build_checkpoint

    from rollout.models import load_pretrained
    from rollout.rl.manager import RolloutManager, RolloutManagerConfig
    from rollout.tokenizers import load_tokenizer

    ckpt = tmp_path / "ckpt"
    build_checkpoint(ckpt)
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                    num_generations=4, max_completion_length=4, max_steps=2, report_to=[],
                    use_cpu=True, save_strategy="no")  # fmt: skip
    names = dict(
        ckpt=ckpt, load_pretrained=load_pretrained, RolloutManager=RolloutManager,
        RolloutManagerConfig=RolloutManagerConfig, load_tokenizer=load_tokenizer,
        GRPOTrainer=trl.GRPOTrainer, GRPOConfig=lambda *_, **kw: trl.GRPOConfig(**{**defaults, **kw}),
        reward=lambda completions, **kw: [float(len(c)) for c in completions],
        dataset=datasets.Dataset.from_dict({"prompt": ["abc>", "xyz>"]}),
        tokenizer=AutoTokenizer.from_pretrained(ckpt),
    )  # fmt: skip
    ns = exec_snippet("### TRL's GRPOTrainer", names)
    try:
        assert ns["trainer"].state.global_step == 2
        assert ns["manager"].version == 3  # train start + one push per step
    finally:
        ns["manager"].close()


def test_lora_snippet():
    """The LoRA block: 2 steps of a PEFT-wrapped Qwen3, each pushing the adapter alone."""
    ns = exec_snippet(
        "### LoRA: push the adapter, not the merged model", {"print": lambda *a: None}
    )
    manager, policy = ns["manager"], ns["policy"]
    assert manager.version == 2
    adapter = sum(p.numel() * 4 for n, p in policy.named_parameters() if "lora_" in n)
    scales = sum("lora_A" in n for n, _ in policy.named_parameters())  # one fp32 per module
    assert manager.stats()["weight_sync/bytes"] == adapter + 4 * scales  # the scale travels too
    assert adapter < sum(p.numel() * 4 for p in policy.parameters()) / 5


def test_episode_snippet():
    """The multi-turn example: 4 groups x 4 episodes of the guessing game, masks and turns."""
    from rollout import InferenceConfig
    from rollout.models import ModelConfig, build_model
    from rollout.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    policy = build_model(ModelConfig.preset("tiny", vocab_size=tok.vocab_size), seed=0)
    names = dict(policy_copy=policy, tok=tok, icfg=InferenceConfig(max_sequence_length=128))
    ns = exec_snippet("### Multi-turn, tool-using episodes", names)
    episodes, manager = ns["episodes"], ns["manager"]
    try:
        assert len(episodes) == 16 and not any(s.failed for s in episodes)
        assert all(1 <= len(s.turns) <= 4 for s in episodes)
        assert any(0 in s.loss_mask for s in episodes)  # some guess missed: an observation
        assert all(s.finish_reason in ("done", "max_turns") for s in episodes)
    finally:
        manager.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inference_snippet(tmp_path):
    """The inference library: a saved checkpoint, direct generate, then 2 engine processes
    behind the coordinator through the acknowledged lifecycle and a weight update."""
    from rollout.models import load_pretrained

    ckpt = make_checkpoint(tmp_path / "ckpt", "llama", bos=True)
    new_model, _ = load_pretrained(ckpt)
    ns = exec_snippet("### As an inference library", {"new_model": new_model},
                      **{"path/to/hf_checkpoint": str(ckpt)})  # fmt: skip
    assert len(ns["out"]) == 2
