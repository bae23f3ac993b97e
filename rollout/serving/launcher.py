"""Where a cluster's coordinator and engines run: local processes, or Ray actors.

`EngineCluster` starts its coordinator and engines through a launcher and gets back
process-like handles (`multiprocessing.Process` for `local`, `ActorProcess` for `ray`), so its
supervision, weight updates and teardown are the same code for both. Ray is the optional extra
`ray`: asking for it without Ray installed is refused here, before anything starts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

LAUNCHERS = ("local", "ray")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Options of the ray launcher (rollout.ray.* in the run config; EngineCluster's `ray=`)
RAY_OPTIONS = ("address", "namespace", "placement_strategy", "cpus_per_engine",
               "gpus_per_engine", "object_store_memory", "placement_timeout_s")  # fmt: skip
INSTALL_RAY = "pip install rollout[ray] (or, from a checkout, pip install -e '.[ray]')"


def ray_missing() -> bool:
    """True when Ray cannot be imported here (the `ray` extra is not installed)."""
    try:
        return importlib.util.find_spec("ray") is None
    except (ImportError, ValueError):  # a broken or stubbed-out module
        return True


def ray_problem(what: str) -> str | None:
    """The message for `what` (the setting that asked for Ray) when Ray is absent, else None."""
    if not ray_missing():
        return None
    return f"{what} needs Ray, which is not installed: {INSTALL_RAY}"


def check_ray_options(options: Mapping[str, Any], where: str = "ray") -> None:
    """ValueError naming the first unknown or ill-typed ray option."""
    unknown = sorted(set(options) - set(RAY_OPTIONS))
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {unknown}; known: {list(RAY_OPTIONS)}")
    strategy = options.get("placement_strategy", "PACK")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"{where}.placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                         f"got {strategy!r}")  # fmt: skip
    for name in ("cpus_per_engine", "gpus_per_engine"):
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not value >= 0):
            raise ValueError(f"{where}.{name} must be a number >= 0, got {value!r}")


def make_launcher(kind: str, num_engines: int, ray: Mapping[str, Any] | None) -> Any:
    """The launcher `kind` names (ValueError naming `launcher` for an unknown one, saying what to
    install when Ray is asked for and absent)."""
    if kind not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {kind!r}")
    if kind == "local":
        if ray:
            raise ValueError("ray options apply only with launcher='ray'")
        return LocalLauncher()
    problem = ray_problem("launcher='ray'")
    if problem is not None:
        raise ValueError(problem)
    check_ray_options(dict(ray or {}))
    from rollout.serving.ray_launcher import RayLauncher  # imports ray: the optional extra

    return RayLauncher(num_engines, **dict(ray or {}))


class LocalLauncher:
    """Coordinator and engines as spawned child processes of this one (they die with it)."""

    remote = False  # engines share this host (and its files and devices)

    def start_coordinator(self, config: Mapping[str, Any]) -> tuple[Any, str, str | None]:
        from rollout.serving.coordinator import DataParallelInferenceCoordinator

        return DataParallelInferenceCoordinator.spawn(30.0, **config)

    def start_engine(
        self,
        address: str,
        rank: int,
        factory: Callable[..., Any],
        factory_kwargs: dict[str, Any],
        worker_kwargs: dict[str, Any],
    ) -> Any:
        from rollout.serving.worker import EngineWorker

        return EngineWorker.spawn(address, rank, factory, factory_kwargs, worker_kwargs)

    def close(self) -> None:
        pass
