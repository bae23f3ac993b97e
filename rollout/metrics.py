"""Metrics: W&B logging under fixed namespaces and staleness summaries.

Every key is `<namespace>/<name>` with the namespace one of `NAMESPACES`, so dashboards and
alerts built for one run work for every run (a typo'd namespace raises instead of creating a new
panel). W&B runs offline unless an API key is set, so a CPU box needs no account and
`wandb sync <run dir>` uploads later. `read_offline_run` parses an offline run's `.wandb` file
back (no network, no W&B API) so tests and recipes can check what was logged.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
import os
import struct
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

NAMESPACES = ("rollout", "engine", "coordinator", "weight_sync", "staleness", "train", "mismatch")
WANDB_MODES = ("offline", "online", "disabled")


def check_keys(metrics: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first key outside `<namespace>/<name>`."""
    for key in metrics:
        ns, sep, rest = str(key).partition("/")
        if not sep or not rest or ns not in NAMESPACES:
            raise ValueError(
                f"metric key {key!r} is outside the fixed namespaces; use '<ns>/<name>' with ns in "
                f"{list(NAMESPACES)}"
            )


def resolve_mode(mode: str | None) -> str:
    """None / "auto" -> "online" when WANDB_API_KEY is set, else "offline"."""
    if mode in (None, "auto"):
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb mode {mode!r} is not one of {[*WANDB_MODES, 'auto']}")
    return mode


class NullLogger:
    """Same interface as MetricsLogger without W&B; still checks keys and keeps the history."""

    mode = "disabled"
    run = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.history: list[dict[str, float]] = []
        self.config: dict[str, Any] = {}
        self._last_step = -1

    @property
    def run_dir(self) -> Path | None:
        return None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> dict[str, Any]:
        """Validate keys, convert tensors/numpy scalars, remember the scalars; returns the row."""
        check_keys(metrics)
        if step is None:
            step = self._last_step + 1
        if not isinstance(step, int) or step < self._last_step:
            raise ValueError(
                f"step must be an int >= the last logged step {self._last_step}, got {step!r}"
            )
        row = {k: _to_loggable(k, v) for k, v in metrics.items()}
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        if self.history and self.history[-1]["step"] == step:
            self.history[-1].update(scalars)
        else:
            self.history.append({"step": step, **scalars})
        self._last_step = step
        self._write(row, step)
        return row

    def log_config(self, config: Any) -> dict[str, Any]:
        """Store the resolved config (dataclass, DictConfig or dict) as plain JSON-able data."""
        plain = to_plain(config)
        if not isinstance(plain, dict):
            raise ValueError(f"config must be a mapping or dataclass, got {type(config).__name__}")
        self.config.update(plain)
        self._write_config(plain)
        return plain

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one scalar key, for plots and reward curves."""
        pts = [(r["step"], r[key]) for r in self.history if key in r]
        return [s for s, _ in pts], [v for _, v in pts]

    def finish(self) -> None:
        pass

    def _write(self, row: dict[str, Any], step: int) -> None:
        pass

    def _write_config(self, plain: dict[str, Any]) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


class MetricsLogger(NullLogger):
    """A W&B run with namespaced keys. mode: None/"auto" (online iff WANDB_API_KEY), "offline",
    "online" or "disabled" (no W&B at all). `dir` holds the run files (`<dir>/wandb/...`)."""

    def __init__(
        self,
        project: str = "rollout",
        mode: str | None = None,
        dir: str | os.PathLike | None = None,
        name: str | None = None,
        config: Any = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        self.mode = resolve_mode(mode)
        self.run = None
        if self.mode != "disabled":
            import wandb

            if dir is not None:
                Path(dir).mkdir(parents=True, exist_ok=True)
            settings = wandb.Settings(silent=True, console="off")
            self.run = wandb.init(
                project=project, mode=self.mode, dir=None if dir is None else str(dir), name=name,
                reinit="create_new", settings=settings, **init_kwargs,
            )  # fmt: skip
        if config is not None:
            self.log_config(config)

    @property
    def run_dir(self) -> Path | None:
        """The run's folder (`.../wandb/offline-run-*`), where `wandb sync` and plots go."""
        return None if self.run is None else Path(self.run.dir).parent

    def _write(self, row: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(row, step=step)

    def _write_config(self, plain: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.config.update(plain, allow_val_change=True)

    def finish(self, timeout_s: float = 30.0) -> None:
        """Finish the run; offline, also wait until its `.wandb` file holds the exit record.

        wandb-core writes the offline file asynchronously and `run.finish()` can return before
        anything is on disk (seen with wandb 0.31), so a reader right after would see an empty
        run. Warns (does not raise) if the file is still incomplete after `timeout_s`.
        """
        if self.run is None:
            return
        run_dir, offline = self.run_dir, self.mode == "offline"
        self.run.finish()
        self.run = None
        if offline and run_dir is not None and not _wait_for_exit_record(run_dir, timeout_s):
            warnings.warn(f"W&B offline run {run_dir} is still incomplete after {timeout_s} s",
                          RuntimeWarning, stacklevel=2)  # fmt: skip


def _wait_for_exit_record(run_dir: Path, timeout_s: float) -> bool:
    """Poll the run file (every 20 ms) until its exit record is there; False on timeout."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for data in _leveldb_records(_find_wandb_file(run_dir)):
                rec = pb.Record()
                rec.ParseFromString(data)
                if rec.WhichOneof("record_type") == "exit":
                    return True
        except (FileNotFoundError, ValueError, DecodeError):
            pass  # not created yet / a record half written
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def make_logger(mode: str | None = None, **kwargs: Any) -> NullLogger:
    """MetricsLogger, or a NullLogger when mode == "disabled" (no wandb import at all)."""
    if resolve_mode(mode) == "disabled":
        logger = NullLogger()
        if kwargs.get("config") is not None:
            logger.log_config(kwargs["config"])
        return logger
    return MetricsLogger(mode=mode, **kwargs)


# -- plots -----------------------------------------------------------------------------------------


def save_plot(
    history: NullLogger | Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    keys: Sequence[str] = ("train/reward", "staleness/policy_mean", "staleness/policy_max"),
    title: str | None = None,
) -> Path:
    """PNG with one panel per key (value against step) from a logger's or a list's history.

    Keys never logged are skipped; at least one must exist. Needs matplotlib (extra `dev`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is in the dev extra
        raise ImportError("save_plot needs matplotlib: pip install 'rollout[dev]'") from e
    rows = history.history if isinstance(history, NullLogger) else list(history)
    series = {}
    for key in keys:
        pts = [(r.get("step", r.get("_step", i)), r[key]) for i, r in enumerate(rows) if key in r]
        if pts:
            series[key] = pts
    if not series:
        raise ValueError(f"none of {list(keys)} was logged; nothing to plot")
    fig, axes = plt.subplots(
        len(series), 1, figsize=(6, 2.2 * len(series)), sharex=True, squeeze=False
    )
    for ax, (key, pts) in zip(axes[:, 0], series.items(), strict=True):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- staleness -------------------------------------------------------------------------------------


def staleness_summary(
    policy: torch.Tensor | Sequence[torch.Tensor],
    kv: torch.Tensor | Sequence[torch.Tensor] | None = None,
    histograms: bool = True,
) -> dict[str, Any]:
    """Token-weighted staleness statistics of the trained tokens.

    `policy`/`kv`: per-token staleness as `Sample.policy_staleness`/`kv_staleness` define it
    (docs/internals.md, "Staleness"), one tensor or list per sample or one flat tensor; pass the
    completion slice. The one summary behind every `staleness/{policy,kv}_*` key (the manager's
    `stats()` and the recipes' batch metrics). Every token counts once, so long samples weigh
    more than short ones (that is what the loss sees). Returns staleness/{policy,kv}_{mean,max,p50,p99,stale_frac}, staleness/tokens and,
    with `histograms`, wandb.Histogram objects under staleness/{policy,kv}_hist.
    """
    out: dict[str, Any] = {}
    for name, values in (("policy", policy), ("kv", kv)):
        if values is None:
            continue
        x = _flat_numpy(values)
        if name == "policy":
            out["staleness/tokens"] = float(x.size)
        if x.size == 0:
            out.update(
                {f"staleness/{name}_{s}": 0.0 for s in ("mean", "max", "p50", "p99", "stale_frac")}
            )
            continue
        if (x < 0).any():
            raise ValueError(f"{name} staleness has negative values (min {x.min()})")
        out[f"staleness/{name}_mean"] = float(x.mean())
        out[f"staleness/{name}_max"] = float(x.max())
        out[f"staleness/{name}_p50"] = float(np.percentile(x, 50))
        out[f"staleness/{name}_p99"] = float(np.percentile(x, 99))
        out[f"staleness/{name}_stale_frac"] = float((x > 0).mean())
        if histograms:
            out[f"staleness/{name}_hist"] = integer_histogram(x)
    return out


def integer_histogram(x: np.ndarray | torch.Tensor | Sequence[int]) -> Any:
    """wandb.Histogram with one bin per integer value 0..max (at most 512 bins)."""
    import wandb

    x = _flat_numpy(x)
    top = int(x.max()) if x.size else 0
    edges = np.linspace(-0.5, top + 0.5, min(top + 1, 512) + 1)
    return wandb.Histogram(np_histogram=np.histogram(x, bins=edges))


def _flat_numpy(values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().reshape(-1).cpu().double().numpy()
    if isinstance(values, np.ndarray):
        return values.reshape(-1).astype(np.float64)
    parts = [_flat_numpy(v) if isinstance(v, (torch.Tensor, np.ndarray)) else np.asarray(v, np.float64).reshape(-1)
             for v in values]  # fmt: skip
    return np.concatenate(parts) if parts else np.zeros(0)


# -- conversion helpers ----------------------------------------------------------------------------


def _to_loggable(key: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor with {value.numel()} elements; log a scalar "
                             "or a histogram (rollout.metrics.integer_histogram / wandb.Histogram)")  # fmt: skip
        value = value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (str, bytes, Mapping, list, tuple)) or value is None:
        raise ValueError(
            f"metric {key!r} must be a number or a wandb media object, got {type(value).__name__}"
        )
    return value  # wandb.Histogram and other wandb data types


def to_plain(config: Any) -> Any:
    """Dataclass / DictConfig / Enum / Path tree -> JSON-able dicts, lists and scalars (resolved)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        DictConfig = ListConfig = ()  # type: ignore[assignment]
    if isinstance(config, (DictConfig, ListConfig)):
        return to_plain(OmegaConf.to_container(config, resolve=True, enum_to_str=True))
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {str(k): to_plain(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_plain(v) for v in config]
    if isinstance(config, enum.Enum):
        return config.name
    if isinstance(config, os.PathLike):
        return os.fspath(config)
    return config


# -- reading an offline run back -------------------------------------------------------------------

_WANDB_MAGIC = b":W&B"
_BLOCK = 32768
_HEADER = 7  # checksum u32, length u16, type u8 (LevelDB log format)


def read_offline_run(path: str | os.PathLike) -> dict[str, Any]:
    """Parse an offline W&B run: {"history": [row per step], "config": {...}, "summary": {...}}.

    `path`: the run folder (`offline-run-*`), its `.wandb` file, or a `wandb/` folder (its
    latest run). Rows hold the logged keys plus `_step`; histograms come back as dicts with
    `_type`, `values` and `bins`. wandb 0.31 writes only this LevelDB-framed protobuf log offline
    (no wandb-history.jsonl), so this is the way to check a run without uploading it.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    for data in _leveldb_records(_find_wandb_file(Path(path))):
        rec = pb.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(_items(rec.history.item))
        elif kind == "run":
            config.update(_items(rec.run.config.update))
        elif kind == "config":
            config.update(_items(rec.config.update))
        elif kind == "summary":
            summary.update(_items(rec.summary.update))
    config.pop("_wandb", None)
    return {"history": history, "config": config, "summary": summary}


def _find_wandb_file(path: Path) -> Path:
    if path.is_file():
        return path
    if (path / "latest-run").exists():
        path = (path / "latest-run").resolve()
    elif (path / "wandb" / "latest-run").exists():
        path = (path / "wandb" / "latest-run").resolve()
    files = sorted(path.glob("run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file under {path}")
    return files[-1]


def _leveldb_records(path: Path) -> Iterable[bytes]:
    data = path.read_bytes()
    if data[:4] != _WANDB_MAGIC:
        raise ValueError(f"{path} is not a W&B run file (bad magic {data[:4]!r})")
    pos, pending = 7, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left - _HEADER
            continue
        chunk = data[pos : pos + length]
        pos += length
        if kind == 1:  # FULL
            yield chunk
        elif kind == 2:  # FIRST
            pending = chunk
        elif kind == 3:  # MIDDLE
            pending += chunk
        elif kind == 4:  # LAST
            yield pending + chunk
            pending = b""
        else:
            raise ValueError(f"{path}: corrupt record type {kind} at byte {pos}")


def _items(items: Iterable[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        keys = [item.key] if item.key else list(item.nested_key)
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = json.loads(item.value_json)
    return out
