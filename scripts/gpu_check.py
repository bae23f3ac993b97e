"""The GPU path in one command: every claim about CUDA checked, timed and written to one JSON.

A GPU machine is lent only now and then, without a network and for 10 minutes a command, so the
whole CUDA story has to be provable in one run; `--device cpu` runs the same stages with small
shapes inside the normal test suite (tests/test_gpu_check.py), so this script cannot rot between
GPU runs. Stages, each in its own process (a crash or a CUDA fault stays in its stage, and the
memory stage measures a clean device) under its own time budget:

  environment      torch/CUDA/package versions; the carried wheels' requirements are met
  cuda_tests       `pytest -m cuda` (skipped on CPU)
  hf_parity        greedy decode and log-probs of our engine == transformers, same checkpoint
  suspend_memory   bytes the engine reports freed == what the device got back, per suspend mode;
                   a training-sized allocation fits only while suspended (CUDA; gpu_memory.py)
  ipc_weight_sync  rollout.weights.ipc.benchmark_ipc_sync: IPC handover vs a plain copy, s/GB
  throughput       engine tokens/s vs transformers generate(), benchmarks/engine_vs_hf.py's
                   two workloads; on CUDA the torch attention backend beside the default (flex);
                   async scheduling (engine.async_scheduling) on beside off
  decode_profile   one decode step under the torch profiler: wall vs device-busy ms, kernels
                   and host syncs per step, the top ops (gpu_profile.py)
  grpo_recipe      a short `python -m recipes.grpo_reverse` run (engine=gpu on CUDA), rewards
  staged_update    the longest decode stall of a weight update while generating, today's
                   pause vs staged (benchmarks/staged_update.py), in decode steps
  speed            Qwen3-0.6B/1.7B-shaped random weights: decode at batch 1-256 and a prefill
                   mix against the card's bandwidth and bf16 peak, beside transformers, the
                   issue-24 targets as pass/fail fields (gpu_speed.py)

    python scripts/gpu_check.py --device cpu --out /tmp/gpu_check.json   # anywhere, ~20 s
    bash scripts/gpu_check.sh                                            # on the GPU machine

A stage passes, fails (with its error), is skipped (not meaningful on this device) or is
not_available (the code it measures is not in this tree). Exit code 0 iff none failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # the stage modules beside this file, however loaded
from gpu_memory import stage_suspend_memory  # noqa: E402
from gpu_profile import stage_decode_profile  # noqa: E402
from gpu_speed import stage_speed  # noqa: E402

MiB = 2**20
GiB = 2**30


class Skipped(Exception):
    """The stage means nothing on this device (not a failure)."""


class NotAvailable(Exception):
    """What the stage measures is not in this tree yet (not a failure)."""


class Ctx:
    """What a stage gets: the device, a scratch folder, and a place to record checks."""

    def __init__(self, device: str, workdir: Path, budget_s: float) -> None:
        self.device, self.workdir, self.budget_s = device, workdir, budget_s
        self.cuda = device.startswith("cuda")
        self.details: dict[str, Any] = {}
        self.checks: dict[str, bool] = {}

    def check(self, name: str, ok: bool) -> bool:
        self.checks[name] = bool(ok)
        print(f"  check {name}: {'ok' if ok else 'FAILED'}", flush=True)
        return bool(ok)


# -- stages -----------------------------------------------------------------------------------


def stage_environment(ctx: Ctx) -> None:
    import torch

    d = ctx.details
    d.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
             cuda_available=torch.cuda.is_available(), platform=platform.platform())  # fmt: skip
    if ctx.cuda and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        d.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GiB, 1),
                 multiprocessors=props.multi_processor_count)  # fmt: skip
    ctx.check("device_available", not ctx.cuda or torch.cuda.is_available())
    versions, broken = {}, {}
    for module in ("zmq", "msgpack", "hydra", "omegaconf", "wandb", "safetensors", "tokenizers",
                   "transformers", "numpy", "pytest", "pytest_asyncio", "psutil"):  # fmt: skip
        try:
            versions[module] = getattr(__import__(module), "__version__", "?")
        except Exception as e:  # a wheel that does not import is this stage's finding
            broken[module] = f"{type(e).__name__}: {e}"
    d.update(versions=versions, import_errors=broken, unmet_requirements=unmet_requirements())
    ctx.check("imports", not broken)
    ctx.check("requirements_met", not d["unmet_requirements"])


def unmet_requirements() -> list[str]:
    """Requires-Dist of the project and every carried wheel, checked against what imports here:
    a version floor the GPU image does not meet shows up here, not as a riddle three stages on."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:
        return []
    names = ["pyzmq", "hydra-core", "omegaconf", "wandb", "pytest-asyncio", "pydantic"]
    wheels = ROOT / ".whl"
    if wheels.is_dir():
        names = sorted({w.name.split("-")[0] for w in wheels.glob("*.whl")})
    problems = []
    for name in names:
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{name} needs {req}: missing")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: have {have}")
    return problems


def stage_cuda_tests(ctx: Ctx) -> None:
    if not ctx.cuda:
        raise Skipped("CPU mode: the CUDA-marked tests run only on a GPU")
    import xml.etree.ElementTree as ET

    junit = ctx.workdir / "cuda_tests.xml"
    # Only the modules that hold CUDA tests: the others need dev-only packages (openai,
    # prometheus_client) that the GPU image lacks, and one collection error stops the session.
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.cuda" in f.read_text())  # fmt: skip
    ctx.details["files"] = files
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "--continue-on-collection-errors", f"--junitxml={junit}", *files]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, timeout=max(10, ctx.budget_s - 15))
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]  # fmt: skip
    ctx.details.update(returncode=proc.returncode, failed_tests=failed, **counts)
    ctx.check("collected_some", counts["tests"] > 0)
    ctx.check("none_failed", counts["failures"] == 0 and counts["errors"] == 0)


# Parity tolerances, on log-probs (natural log). fp32: same math, different kernels -> ~1e-6;
# bf16: 8 mantissa bits, our attention vs SDPA round differently -> a few 1e-2 on peaked logits.
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 0.1}


def stage_hf_parity(ctx: Ctx) -> None:
    import torch
    import transformers

    from rollout.engine import DynamicInferenceEngine, InferenceConfig
    from rollout.models import load_pretrained
    from rollout.sampling import SamplingParams

    torch.manual_seed(0)
    shape = (dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4) if ctx.cuda else
             dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    hf_cfg = transformers.LlamaConfig(**shape, max_position_embeddings=512, rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(hf_cfg)
    with torch.no_grad():  # larger than init weights: peaked distributions, few exact ties
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    ckpt = ctx.workdir / "hf_llama"
    hf.save_pretrained(ckpt)
    g = torch.Generator().manual_seed(1)
    lengths = [5, 17, 33, 64] if ctx.cuda else [3, 9, 20]
    prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    new = 32 if ctx.cuda else 12
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        ours, _ = load_pretrained(ckpt, device=ctx.device, dtype=dtype)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=dtype, attn_implementation="sdpa"
        )
        theirs = theirs.to(ctx.device).eval()
        eng = DynamicInferenceEngine(ours, None, InferenceConfig(max_sequence_length=256,
                                                                 kv_cache_memory_bytes=16 * MiB))  # fmt: skip
        sp = SamplingParams(temperature=0.0, num_tokens_to_generate=new, ignore_eos=True,
                            return_log_probs=True)  # fmt: skip
        results = eng.generate(prompts, sp)
        ctx.details[dtype_name] = compare_with_hf(theirs, prompts, results, new, ctx.device,
                                                  LOGPROB_TOL[dtype_name])  # fmt: skip
        r = ctx.details[dtype_name]
        ctx.check(f"{dtype_name}_greedy_equal_up_to_ties", r["untied_divergences"] == 0)
        ctx.check(f"{dtype_name}_logprobs_within_tol", r["max_abs_logprob_diff"] <= r["tolerance"])
        del eng, ours, theirs
        if ctx.cuda:
            torch.cuda.empty_cache()


def compare_with_hf(hf: Any, prompts: list[list[int]], results: list[Any], new: int,
                    device: str, tol: float) -> dict[str, Any]:  # fmt: skip
    """Greedy tokens vs HF generate(); our log-probs vs HF's teacher-forced on our tokens.

    A divergence counts as a tie when HF itself scores our token within `tol` of its own pick
    (two near-equal logits that rounding orders either way); after it the sequences differ
    legitimately and only the log-probs (teacher-forced on our tokens) are compared.
    """
    import torch

    exact, ties, untied, worst, diffs = 0, 0, 0, 0.0, []
    for prompt, res in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, eos_token_id=None)  # fmt: skip
            theirs = out[0, len(prompt) :].tolist()
            full = torch.tensor([prompt + list(res.generated_tokens)], device=device)
            logp = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        ours = list(res.generated_tokens)
        steps = logp[len(prompt) - 1 : -1]  # row i predicts generated token i
        ref = steps.gather(1, torch.tensor(ours, device=device)[:, None])[:, 0]
        diff = (ref.cpu() - torch.tensor(res.generated_log_probs)).abs()
        worst = max(worst, diff.max().item())
        diffs.append(diff.mean().item())
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if k is None:
            exact += 1
        elif (steps[k, theirs[k]] - steps[k, ours[k]]).abs().item() <= tol:
            ties += 1
        else:
            untied += 1
    return {"prompts": len(prompts), "new_tokens": new, "exact": exact, "tie_divergences": ties,
            "untied_divergences": untied, "max_abs_logprob_diff": worst,
            "mean_abs_logprob_diff": sum(diffs) / len(diffs), "tolerance": tol}  # fmt: skip


def stage_ipc_weight_sync(ctx: Ctx) -> None:
    try:
        from rollout.weights import ipc
    except ImportError as e:
        raise NotAvailable(f"rollout.weights.ipc is not in this tree ({e})") from e
    bench = getattr(ipc, "benchmark_ipc_sync", None)
    if bench is None:
        raise NotAvailable("rollout.weights.ipc has no benchmark_ipc_sync")
    nbytes = GiB if ctx.cuda else 16 * MiB
    params = inspect.signature(bench).parameters
    kwargs = {k: v for k, v in (("nbytes", nbytes), ("device", ctx.device)) if k in params}
    result = bench(**kwargs) if kwargs else bench(nbytes, ctx.device)
    ctx.details.update(nbytes=nbytes, result=jsonable(result))
    ctx.check("returned_a_result", result is not None)
    if isinstance(result, dict) and "identical" in result:
        ctx.check("received_weights_identical", bool(result["identical"]))


def stage_throughput(ctx: Ctx) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import engine_vs_hf as bench

    from rollout.models import ModelConfig, build_model

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    device = torch.device(ctx.device)
    if ctx.cuda:
        sizes, new, lo, hi, n_batch, n_grpo, samples = ["small", "medium"], 128, 16, 512, 32, 16, 8
    else:
        sizes, new, lo, hi, n_batch, n_grpo, samples = ["tiny"], 8, 8, 32, 4, 2, 4
    workloads = {"a_batch": (n_batch, 1, True), "b_grpo": (n_grpo, samples, False)}
    ctx.details.update(dtype=str(dtype), new_tokens=new, prompt_lengths=[lo, hi], runs=[])
    for size in sizes:
        config = ModelConfig.preset(size)
        model = build_model(config, seed=0).to(device=device, dtype=dtype).eval()
        hf = bench.load_hf(model, config, device, dtype)
        for name, (n, k, greedy) in workloads.items():
            prompts = bench.make_prompts(n, lo, hi, config.vocab_size, seed=len(name))
            # Warm-up on the workload's own shapes (CUDA's lazy kernel loading, cuBLAS plans,
            # graph captures): otherwise the process's first timed run carries them.
            for graphs in (True, False):
                bench.run_ours(model, prompts, k, 4, greedy, device, 16, cuda_graphs=graphs)
            if ctx.cuda:  # the default is flex there: the torch backend side by side
                bench.run_ours(model, prompts, k, 4, greedy, device, 16, attention_backend="torch")
            bench.run_hf(hf, prompts, k, 4, greedy, device)
            ours = bench.run_ours(model, prompts, k, new, greedy, device, 16)
            eager = bench.run_ours(model, prompts, k, new, greedy, device, 16, cuda_graphs=False)
            overlap = bench.run_ours(model, prompts, k, new, greedy, device, 16,
                                     async_scheduling=True)  # fmt: skip
            other = None
            if ctx.cuda:
                other = bench.run_ours(model, prompts, k, new, greedy, device, 16,
                                       attention_backend="torch")  # fmt: skip
            theirs = bench.run_hf(hf, prompts, k, new, greedy, device)
            row = {"model": size, "params": config.num_parameters(), "workload": name,
                   "requests": n * k, "ours_tokens_per_s": ours["tokens_per_s"],
                   "ours_eager_tokens_per_s": eager["tokens_per_s"],
                   "ours_async_scheduling_tokens_per_s": overlap["tokens_per_s"],
                   "hf_tokens_per_s": theirs["tokens_per_s"],
                   "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
                   "eager_speedup": eager["tokens_per_s"] / theirs["tokens_per_s"],
                   "attention_backend": ours["attention_backend"]}  # fmt: skip
            if other is not None:
                row["ours_torch_attention_tokens_per_s"] = other["tokens_per_s"]
            ctx.details["runs"].append(row)
            print(f"  {size} {name}: ours ({row['attention_backend']}) "
                  f"{row['ours_tokens_per_s']:.0f} tok/s (eager "
                  f"{row['ours_eager_tokens_per_s']:.0f}, async scheduling "
                  f"{row['ours_async_scheduling_tokens_per_s']:.0f}"
                  + (f", torch attention {other['tokens_per_s']:.0f}" if other else "")
                  + f"), hf {row['hf_tokens_per_s']:.0f} tok/s, x{row['speedup']:.2f}",
                  flush=True)  # fmt: skip
            ctx.check(f"{size}_{name}_all_tokens",
                      ours["tokens"] == eager["tokens"] == overlap["tokens"] == theirs["tokens"]
                      == n * k * new
                      and (other is None or other["tokens"] == n * k * new))  # fmt: skip
            if ctx.cuda:  # flex is the default there; a fallback to torch is logged and fails
                ctx.check(f"{size}_{name}_flex_ran", ours["attention_backend"] == "flex")
        del model, hf
        if ctx.cuda:
            torch.cuda.empty_cache()


def stage_grpo_recipe(ctx: Ctx) -> None:
    out = ctx.workdir / "grpo"
    if ctx.cuda:
        steps = 8
        overrides = ["engine=gpu", f"trainer.steps={steps}", "trainer.warmup_sft_steps=100",
                     "recipe.eval_every=4", "recipe.eval_prompts=64", "logger=offline"]  # fmt: skip
    else:  # tests/test_recipes.py's tiny run
        steps = 3
        overrides = [f"trainer.steps={steps}", "trainer.warmup_sft_steps=2", "trainer.batch=4",
                     "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                     "recipe.eval_every=2", "recipe.eval_prompts=4", "logger=disabled",
                     "logger.plot=false"]  # fmt: skip
    cmd = [sys.executable, "-m", "recipes.grpo_reverse", *overrides,
           f"logger.dir={out}", f"hydra.run.dir={out}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(10, ctx.budget_s - 10))
    ctx.details["returncode"] = proc.returncode
    ctx.check("exit_0", proc.returncode == 0)
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [r for r in metrics["history"] if "train/reward" in r]
    summary = metrics["summary"]
    ctx.details.update(device=metrics["config"]["model"]["device"],
                       rewards=[round(r["train/reward"], 4) for r in rows],
                       **{k: summary.get(k) for k in ("steps", "start_reward", "end_reward",
                          "start_eval_reward", "end_eval_reward", "final_version")})  # fmt: skip
    ctx.check("ran_on_device", str(ctx.details["device"]).split(":")[0] == ctx.device.split(":")[0])
    ctx.check("every_step_logged_a_reward", len(rows) == steps)
    ctx.check("rewards_in_range", all(0.0 <= r["train/reward"] <= 1.0 for r in rows))


def stage_staged_update(ctx: Ctx) -> None:
    """benchmarks/staged_update.py on this device: the longest decode stall of a weight update,
    today's pause vs staged (rollout.engine.staging), same run; target: one decode step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import staged_update as bench

    if ctx.cuda:
        preset, shape = "medium", {"batch": 32, "tokens": 128, "updates": 4, "steps_between": 8}
    else:
        preset, shape = "tiny", {"batch": 8, "tokens": 32, "updates": 2, "steps_between": 4}
    result = bench.measure(preset, shape, 1, ctx.device, "bfloat16" if ctx.cuda else None)
    ctx.details.update(jsonable(result))
    for mode in ("pause", "staged"):
        print(f"  {mode}: step {1e3 * result[mode]['median_step_s']:.2f} ms, longest stall "
              f"{1e3 * result[mode]['stall_s']:.2f} ms ({result[mode]['stall_steps']:.2f} "
              "steps)", flush=True)  # fmt: skip
        ctx.check(f"{mode}_reached_every_version", result[mode]["version"] == shape["updates"])
    if ctx.cuda:  # the target; a shared 2-core CPU is too noisy to hold it to one step
        ctx.check("staged_stall_at_most_one_step", result["staged"]["stall_steps"] <= 1.0)


# name -> (function, budget seconds on CUDA, on CPU). Without `speed` the CUDA budgets add up
# to 11 minutes, which no run comes near (the last full one took 4): one 10-minute device
# command with the wheel install. `speed` alone may take its 4 minutes, so on a GPU run it in
# a second command (`--stages environment speed`; README, GPU check).
STAGES: dict[str, tuple[Callable[[Ctx], None], int, int]] = {
    "environment": (stage_environment, 30, 60),
    "cuda_tests": (stage_cuda_tests, 90, 30),
    "hf_parity": (stage_hf_parity, 60, 90),
    "suspend_memory": (stage_suspend_memory, 60, 90),
    "ipc_weight_sync": (stage_ipc_weight_sync, 60, 90),
    "throughput": (stage_throughput, 150, 120),
    "decode_profile": (stage_decode_profile, 60, 60),
    "grpo_recipe": (stage_grpo_recipe, 90, 120),
    "staged_update": (stage_staged_update, 60, 60),
    "speed": (stage_speed, 240, 90),
}


# -- running ----------------------------------------------------------------------------------


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, bool | int | float | str) or x is None:
        return x
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return x.item()
    if hasattr(x, "__dataclass_fields__"):
        return jsonable(vars(x))
    return repr(x)


def run_stage_here(name: str, device: str, workdir: Path, budget_s: float) -> dict[str, Any]:
    """Run one stage in this process; never raises."""
    ctx = Ctx(device, workdir, budget_s)
    status, error = "passed", None
    try:
        STAGES[name][0](ctx)
        bad = [k for k, ok in ctx.checks.items() if not ok]
        if bad:
            status, error = "failed", "checks failed: " + ", ".join(bad)
    except Skipped as e:
        status, error = "skipped", str(e)
    except NotAvailable as e:
        status, error = "not_available", str(e)
    except BaseException as e:
        traceback.print_exc()
        status, error = "failed", f"{type(e).__name__}: {e}"
    return {
        "status": status,
        "error": error,
        "checks": ctx.checks,
        "details": jsonable(ctx.details),
    }


def run_stage_child(name: str, device: str, workdir: Path, budget_s: float, log) -> dict[str, Any]:
    """Run one stage in a child process under its budget; its output goes to the log."""
    result_file = workdir / f"{name}.result.json"
    cmd = [sys.executable, __file__, "--stage", name, "--device", device,
           "--workdir", str(workdir), "--budget", str(budget_s), "--result", str(result_file)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not device.startswith("cuda"):  # small shapes: one thread each, no spinning on a shared box
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=budget_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)  # the stage and whatever it started (pytest, the recipe)
        out, _ = proc.communicate()
        timed_out = True
    text = out.decode(errors="replace")
    log.write(text)
    log.flush()
    if result_file.exists() and not timed_out:
        return json.loads(result_file.read_text())
    why = f"timed out after {budget_s:.0f} s" if timed_out else f"exit code {proc.returncode}"
    return {"status": "failed", "error": f"{why}; output tail: {text[-1500:]}", "checks": {},
            "details": {}}  # fmt: skip


def plot_report(report: dict[str, Any], path: Path) -> bool:
    """Throughput (ours with and without CUDA graphs vs transformers) and the decode step's wall
    vs device-busy time, from a report's stages; False when there is nothing to plot."""
    throughput = report["stages"].get("throughput", {}).get("details", {})
    decode = report["stages"].get("decode_profile", {}).get("details", {})
    runs = throughput.get("runs", [])
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = range(len(runs))
    for dx, key, label in ((-0.27, "ours_tokens_per_s", "rollout engine"),
                           (0.0, "ours_eager_tokens_per_s", "rollout engine, eager"),
                           (0.27, "hf_tokens_per_s", "HF generate()")):  # fmt: skip
        ax.bar([i + dx for i in x], [r.get(key, 0) for r in runs], 0.27, label=label)
    for i, r in enumerate(runs):
        ax.text(i, max(r["ours_tokens_per_s"], r["hf_tokens_per_s"]), f"x{r['speedup']:.1f}",
                ha="center", va="bottom")  # fmt: skip
    ax.set_xticks(list(x), [f"{r['model']}\n{r['workload']}" for r in runs])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"engine vs transformers ({report['device']}, {throughput.get('dtype')})")
    ax.legend()
    modes = [m for m in ("eager", "graphs") if m in decode]
    bx.bar(modes, [decode[m]["wall_ms_per_step"] for m in modes], label="wall")
    bx.bar(modes, [decode[m]["device_busy_ms_per_step"] for m in modes], label="device busy")
    bx.set_ylabel("ms per decode step")
    bx.set_title(f"one decode step ({decode.get('model')}, {decode.get('batch')} rows)")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def default_out(device: str) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "benchmarks" / "results" / f"gpu_check_{device.split(':')[0]}.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--device", default="cuda", help="cuda (the GPU run) or cpu (small shapes)")
    ap.add_argument("--out", default=None, help="the JSON; default $OUT/gpu_check.json when "
                    "$OUT is set, else benchmarks/results/gpu_check_<device>.json")  # fmt: skip
    ap.add_argument("--log", default=None, help="the log; default: --out with .log")
    ap.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every budget")
    ap.add_argument("--plot", metavar="JSON", help="only draw JSON's plot (JSON with .png)")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # child mode: one stage, in-process
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plot:
        return 0 if plot_report(json.loads(Path(args.plot).read_text()),
                                Path(args.plot).with_suffix(".png")) else 1  # fmt: skip
    if args.stage:
        result = run_stage_here(args.stage, args.device, Path(args.workdir), args.budget)
        Path(args.result).write_text(json.dumps(result, indent=1))
        return 0
    out = Path(args.out) if args.out else default_out(args.device)
    log_path = Path(args.log) if args.log else out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": args.device, "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(), "python": sys.executable, "stages": {},
    }  # fmt: skip
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, open(log_path, "w") as log:
        for name in args.stages:
            budget = STAGES[name][1 if args.device.startswith("cuda") else 2] * args.budget_scale
            workdir = Path(tmp) / name
            workdir.mkdir()
            banner = f"=== {name} (budget {budget:.0f} s)"
            print(banner, flush=True)
            log.write(banner + "\n")
            log.flush()
            t0 = time.perf_counter()
            result = run_stage_child(name, args.device, workdir, budget, log)
            result = {"status": result["status"], "seconds": round(time.perf_counter() - t0, 2),
                      "budget_s": budget, **{k: v for k, v in result.items() if k != "status"}}  # fmt: skip
            report["stages"][name] = result
            line = f"--- {name}: {result['status']} in {result['seconds']:.1f} s"
            if result["error"]:
                line += f" ({result['error'][:300]})"
            print(line, flush=True)
            log.write(line + "\n")
            report["total_seconds"] = round(time.perf_counter() - t_all, 2)
            statuses = [s["status"] for s in report["stages"].values()]
            report["all_passed"] = "failed" not in statuses
            report["complete"] = all(s == "passed" for s in statuses)
            out.write_text(json.dumps(report, indent=1) + "\n")  # after every stage: a cut-off
    try:
        if plot_report(report, out.with_suffix(".png")):
            print(f"plot: {out.with_suffix('.png')}")
    except Exception as e:  # the figures are in the JSON whatever happens to the plot
        print(f"no plot ({type(e).__name__}: {e})")
    print(f"wrote {out} and {log_path}: all_passed={report['all_passed']}")  # run keeps the rest
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
