"""Every command README.md documents, run as written: a README line no test runs can rot.

Shared by the README tests of this folder (one module per README section).
`test_readme_index.py` parses the README (```bash blocks, inline commands, and the overrides in
the "Growing from the embedded default" table) and fails on any command that `COVERED` does not
map to a test of this folder. Each test takes its command text from the README itself, fills in
placeholders (a checkpoint path, an address), and appends short-run Hydra overrides (later
overrides win), so it runs the documented command, not a paraphrase. The README's ```python
blocks (`SNIPPETS`) are executed too, with only the names their prose leaves to the reader (your
policy, your loss) predefined.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from rollout.sampling import SamplingParams
from rollout.serving.client import InferenceClient

ROOT = Path(__file__).resolve().parents[2]


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
    "python -m recipes.grpo_reverse rollout.seed=1 rollout.batch_invariant=true": "test_seeded_rerun",
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


def exec_snippet(heading: str, names: dict, **placeholders: str) -> dict:
    """Execute the README block under `heading` with `names` (what the prose leaves to the
    reader: your policy, your loss) predefined; returns its namespace."""
    code = python_snippets(README)[heading]
    for key, value in placeholders.items():
        code = code.replace(key, value)
    namespace = dict(names)
    exec(compile(code, f"README.md: {heading}", "exec"), namespace)
    return namespace


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
        sp = SamplingParams(temperature=0.0, num_tokens_to_generate=3, ignore_eos=True)  # counted
        recs = await asyncio.gather(*[client.add_request([i + 1] * 5, sp) for i in range(8)])
        return sum(len(r.merge().generated_tokens) for r in recs)
    finally:
        client.stop()
