"""`rollout` command line.

`rollout serve` starts a coordinator and N engine processes on this machine; Ctrl-C or SIGTERM
stops the engines, then the coordinator, and waits for every child: nothing is left behind.
`rollout engine` runs one engine in the foreground that joins a coordinator elsewhere (another
node), so a deployment can grow past one machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from rollout.coordinator.routing import POLICIES


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start a coordinator and N data-parallel engine processes")
    p.add_argument("--model", required=True, help='HF checkpoint directory, or "tiny" (tests)')
    p.add_argument("--dp", type=int, default=1, help="number of engine processes")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--policy", default="load_balanced", choices=POLICIES)
    p.add_argument("--alpha", type=float, default=0.5, help="prefix policies: match weight")
    p.add_argument("--auth-token", default=None, help="shared secret peers must present")
    _add_engine_options(p)
    p.add_argument("--schedule-log", default=None, help="write routing decisions here on exit")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.set_defaults(func=serve)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="engine device (default: the model's)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--streaming-interval", type=int, default=8,
                   help="tokens between partial replies (also failover checkpoints); 0 = off")  # fmt: skip


def _engine_config(args: argparse.Namespace) -> dict:
    return {"block_size": args.block_size, "max_requests": args.max_requests,
            "streaming_interval": args.streaming_interval}  # fmt: skip


def _add_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="run one engine that joins a coordinator (another node)")
    p.add_argument("--coordinator", required=True, help="the address `rollout serve` printed")
    p.add_argument("--model", required=True, help='HF checkpoint directory, or "tiny" (tests)')
    p.add_argument("--rank", type=int, required=True, help="this engine's data-parallel rank")
    p.add_argument("--auth-token", default=None, help="the coordinator's shared secret")
    _add_engine_options(p)
    p.set_defaults(func=engine)


def engine(args: argparse.Namespace) -> int:
    from rollout.engine.worker import EngineWorker, build_engine

    if args.rank < 0:
        raise SystemExit(f"rollout engine: --rank must be >= 0, got {args.rank}")
    built = build_engine(args.model, device=args.device, dtype=args.dtype, **_engine_config(args))
    worker = EngineWorker(built, args.coordinator, args.rank, auth_token=args.auth_token)
    print(f"engine {args.rank} pid {os.getpid()} -> {args.coordinator}", flush=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        worker.run()
    except KeyboardInterrupt:
        worker.close()
    except (ConnectionError, PermissionError) as e:
        raise SystemExit(f"rollout engine: {e}") from None
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _check_serve(args: argparse.Namespace) -> None:
    if args.dp < 1:
        raise SystemExit(f"rollout serve: --dp must be >= 1, got {args.dp}")
    if not 0 <= args.port < 65536:
        raise SystemExit(f"rollout serve: --port must be in [0, 65535], got {args.port}")


def serve(args: argparse.Namespace) -> int:
    from rollout.runtime import EngineCluster

    _check_serve(args)

    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    cluster = EngineCluster(
        args.dp,
        args.model,
        inference_config=_engine_config(args),
        device=args.device,
        dtype=args.dtype,
        coordinator={"host": args.host, "port": args.port, "policy": args.policy,
                     "alpha": args.alpha, "block_size": args.block_size,
                     "schedule_output_path": args.schedule_log},
        auth_token=args.auth_token,
        weight_sync=False,
        ready_timeout_s=args.ready_timeout,
    )  # fmt: skip
    try:
        address = cluster.start_coordinator()
        print(f"coordinator {address} pid {cluster.coordinator_process.pid}", flush=True)
        for rank, proc in enumerate(cluster.start_engines()):
            print(f"engine {rank} pid {proc.pid}", flush=True)
        try:
            cluster.wait_ready()
        except (RuntimeError, TimeoutError, ConnectionError, PermissionError) as e:
            raise SystemExit(f"rollout serve: {e}") from None
        print(f"ready: {args.dp} engine(s) at {address}", flush=True)
        while cluster.coordinator_process.is_alive():
            cluster.coordinator_process.join(1.0)
        print("rollout serve: coordinator exited", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.close()
        print("rollout serve: stopped", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_engine(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
