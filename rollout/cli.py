"""`rollout` command line: `rollout serve` starts a coordinator and N engine processes.

Ctrl-C or SIGTERM stops the engines, then the coordinator, and waits for every child: nothing is
left behind. Other subcommands hang off the same subparser table.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
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
    p.add_argument("--device", default=None, help="engine device (default: the model's)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--streaming-interval", type=int, default=8,
                   help="tokens between partial replies (also failover checkpoints); 0 = off")  # fmt: skip
    p.add_argument("--schedule-log", default=None, help="write routing decisions here on exit")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.set_defaults(func=serve)


def _check_serve(args: argparse.Namespace) -> None:
    if args.dp < 1:
        raise SystemExit(f"rollout serve: --dp must be >= 1, got {args.dp}")
    if not 0 <= args.port < 65536:
        raise SystemExit(f"rollout serve: --port must be in [0, 65535], got {args.port}")


def _wait_for_engines(address: str, n: int, token: str | None, timeout: float, procs) -> None:
    """Handshake as a client and poll STATS until n engines registered (or a child died)."""
    import zmq

    from rollout.protocol import Headers, decode, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(encode(Headers.CONNECT, token))
        deadline = time.monotonic() + timeout
        sid = 0
        while time.monotonic() < deadline:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise SystemExit(f"rollout serve: {dead[0].name} exited with {dead[0].exitcode}")
            sid += 1
            sock.send(encode(Headers.STATS, sid))
            if sock.poll(500):
                header, fields = decode(sock.recv())
                if header is Headers.ERROR:
                    raise SystemExit(f"rollout serve: coordinator refused us: {fields[2]}")
                if header is Headers.STATS_REPLY and len(fields[1]["engines"]) >= n:
                    return
            time.sleep(0.2)  # engines are loading models; a coarse wait is fine here
        raise SystemExit(f"rollout serve: engines not ready within {timeout}s")
    finally:
        sock.send(encode(Headers.DISCONNECT))
        sock.close(linger=100)
        ctx.term()


def serve(args: argparse.Namespace) -> int:
    from rollout.coordinator import DataParallelInferenceCoordinator
    from rollout.engine.worker import EngineWorker, build_engine

    _check_serve(args)
    stopping = {"flag": False}

    def on_signal(signum, frame):
        stopping["flag"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    coord_proc, address = DataParallelInferenceCoordinator.spawn(
        host=args.host,
        port=args.port,
        policy=args.policy,
        alpha=args.alpha,
        auth_token=args.auth_token,
        block_size=args.block_size,
        schedule_output_path=args.schedule_log,
    )
    print(f"coordinator {address} pid {coord_proc.pid}", flush=True)
    engines = []
    factory_kwargs = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_requests": args.max_requests,
        "streaming_interval": args.streaming_interval,
    }
    try:
        for rank in range(args.dp):
            proc = EngineWorker.spawn(address, rank, build_engine, factory_kwargs,
                                      {"auth_token": args.auth_token})  # fmt: skip
            engines.append(proc)
            print(f"engine {rank} pid {proc.pid}", flush=True)
        _wait_for_engines(address, args.dp, args.auth_token, args.ready_timeout,
                          [coord_proc, *engines])  # fmt: skip
        print(f"ready: {args.dp} engine(s) at {address}", flush=True)
        while coord_proc.is_alive():
            coord_proc.join(1.0)
        print("rollout serve: coordinator exited", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _shutdown([*engines, coord_proc])


def _shutdown(procs) -> None:
    """SIGTERM every child, give them a moment to exit cleanly, then SIGKILL stragglers."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
    print("rollout serve: stopped", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
