"""`rollout` command line.

`rollout serve` starts a coordinator and N engine processes on this machine; Ctrl-C or SIGTERM
stops the engines, then the coordinator, and waits for every child: nothing is left behind.
`rollout engine` runs one engine in the foreground that joins a coordinator elsewhere (another
node), so a deployment can grow past one machine.

Peers authenticate with a shared secret that never appears on a command line (every user of the
machine can read those): `rollout serve` takes it from `--auth-token-file` or the environment
(ROLLOUT_AUTH_TOKEN, ROLLOUT_AUTH_TOKEN_FILE), or generates one per launch and writes it to a file
only this user can read, whose path it prints; `rollout engine` reads the same file or variables.
`rollout serve` restarts engines that die (`--max-restarts` per 10 minutes, with backoff).
Beyond loopback every link is encrypted and authenticated with CURVE keyed by that same secret
(rollout.serving.curve); `--curve` overrides the choice (and sets $ROLLOUT_CURVE for the processes
it starts).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.sampling import VLLM_LOGPROBS_MODES
from rollout.serving.auth import new_token, read_token_file, resolve_token
from rollout.serving.coordinator.routing import POLICIES
from rollout.serving.curve import ENV_CURVE
from rollout.serving.launcher import LAUNCHERS, PLACEMENT_STRATEGIES, ray_problem

if TYPE_CHECKING:
    from rollout.serving.cluster import EngineCluster


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start a coordinator and N data-parallel engine processes")
    p.add_argument("--model", required=True, help='HF checkpoint directory, or "tiny" (tests)')
    p.add_argument("--dp", type=int, default=1, help="number of engine processes")
    p.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--policy", default="load_balanced", choices=POLICIES)
    p.add_argument("--alpha", type=float, default=0.5, help="prefix policies: match weight")
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the shared secret peers must present (default: "
        "$ROLLOUT_AUTH_TOKEN(_FILE), else a new one written to a 0600 file)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="no secret at all: any local process may join (trusted hosts only)",
    )
    _add_curve_option(p)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one engine within 10 minutes before it is given up",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        help="seconds before the first restart; doubles per recent crash (max 30)",
    )
    _add_engine_options(p)
    p.add_argument("--schedule-log", default=None, help="write routing decisions here on exit")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    _add_launcher_options(p)
    _add_http_options(p)
    p.set_defaults(func=serve)


def _add_launcher_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launcher", choices=LAUNCHERS, default="local",
                   help="local: engine child processes; ray: coordinator and engines as Ray "
                        "actors in one placement group (pip install rollout[ray])")  # fmt: skip
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else start a local Ray)")  # fmt: skip
    p.add_argument("--placement-strategy", choices=PLACEMENT_STRATEGIES, default="PACK",
                   help="Ray placement of the engine bundles")  # fmt: skip
    p.add_argument("--cpus-per-engine", type=float, default=1.0, help="Ray: CPUs in each bundle")
    p.add_argument("--gpus-per-engine", type=float, default=None,
                   help="Ray: GPUs in each bundle (default: 1 with --device cuda, else 0)")  # fmt: skip


def _launcher(args: argparse.Namespace) -> dict:
    """EngineCluster kwargs for --launcher (refused with what to install when Ray is absent)."""
    if args.launcher == "local":
        given = [flag for flag, value, default in (
            ("--ray-address", args.ray_address, None), ("--placement-strategy", args.placement_strategy, "PACK"),
            ("--cpus-per-engine", args.cpus_per_engine, 1.0), ("--gpus-per-engine", args.gpus_per_engine, None),
        ) if value != default]  # fmt: skip
        if given:
            raise SystemExit(f"rollout serve: {', '.join(given)} apply only with --launcher ray")
        return {}
    problem = ray_problem("rollout serve --launcher ray")
    if problem is not None:
        raise SystemExit(problem)
    gpus = args.gpus_per_engine
    if gpus is None:
        gpus = 1 if str(args.device or "").startswith("cuda") else 0
    return {"launcher": "ray", "ray": {"address": args.ray_address,
                                       "placement_strategy": args.placement_strategy,
                                       "cpus_per_engine": args.cpus_per_engine,
                                       "gpus_per_engine": gpus}}  # fmt: skip


def _add_curve_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--curve",
        choices=("auto", "on", "off"),
        default=None,
        help="CURVE encryption of coordinator links, keyed by the secret (default: "
        "$ROLLOUT_CURVE, else auto: on unless the address is 127.0.0.1, ::1 or localhost)",
    )


def _apply_curve(args: argparse.Namespace) -> None:
    """--curve for this process and the ones it starts (they read $ROLLOUT_CURVE)."""
    if args.curve is not None:
        os.environ[ENV_CURVE] = args.curve


def _add_http_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on this port (0: a free one)",
    )
    p.add_argument("--http-host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument(
        "--http-auth-token-file",
        default=None,
        help="file holding the bearer token HTTP callers must send "
        "(default: $ROLLOUT_HTTP_TOKEN, else no HTTP auth)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="jinja chat template file (default: the checkpoint's own)",
    )
    p.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models and responses (default: --model)")  # fmt: skip
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=sorted(VLLM_LOGPROBS_MODES),
                   help="HTTP log-probs of requests that name no logprobs_mode: raw_logprobs "
                        "(temperature 1) or processed_logprobs (at the request's temperature)")  # fmt: skip
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="parse chat replies' tool calls in this model family's format")  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls when a request has tools and tool_choice "auto"')  # fmt: skip
    _add_http_limits(p)


def _add_http_limits(p: argparse.ArgumentParser) -> None:
    """What the HTTP front end admits (defaults: `Limits` and `ConnectionLimits`)."""
    for flag, kind, default, what in _HTTP_LIMITS:
        p.add_argument(flag, type=kind, default=default, help=what)
    p.add_argument("--http-max-body", action="append", default=[], metavar="ROUTE=BYTES",
                   help="request body cap of a route (default=BYTES: routes not named; "
                        "past it: 413); repeatable")  # fmt: skip


_HTTP_LIMITS = (
    ("--http-max-connections", int, 1024, "open HTTP connections (one more is answered 503)"),
    ("--http-request-timeout", float, 10.0, "seconds for a request to arrive whole"),
    ("--http-write-idle-timeout", float, 60.0,
     "seconds an answer may wait on a caller that reads none of it (then it is cancelled)"),
    ("--http-max-choices", int, 1024, "prompts x n of one request (past it: 400)"),
    ("--http-max-logprobs", int, 20, "top log-probs per token (past it: 400)"),
    ("--http-max-request-tokens", int, 4_000_000,
     "prompt tokens x n + choices x max_tokens of one request (past it: 400)"),
    ("--http-max-inflight-choices", int, 8192, "choices in flight, all callers (past it: 429)"),
    ("--http-max-inflight-tokens", int, 32_000_000, "tokens in flight, all callers (past it: 429)"),
    ("--http-max-caller-share", float, 0.5,
     "fraction of the in-flight limits one caller (client address) may hold (past it: 429)"),
)  # fmt: skip


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="engine device (default: the model's)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-requests", type=int, default=64)
    p.add_argument("--streaming-interval", type=int, default=8,
                   help="tokens between partial replies (also failover checkpoints); 0 = off")  # fmt: skip
    p.add_argument("--batch-invariant", action="store_true",
                   help="each row's logits and log-probs the same bits whatever shares its "
                   "batch (README: Batch-invariant mode)")  # fmt: skip


def _engine_config(args: argparse.Namespace) -> dict:
    return {"block_size": args.block_size, "max_requests": args.max_requests,
            "streaming_interval": args.streaming_interval,
            "batch_invariant": args.batch_invariant}  # fmt: skip


def _add_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="run one engine that joins a coordinator (another node)")
    p.add_argument("--coordinator", required=True, help="the address `rollout serve` printed")
    p.add_argument("--model", required=True, help='HF checkpoint directory, or "tiny" (tests)')
    p.add_argument("--rank", type=int, required=True, help="this engine's data-parallel rank")
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="file holding the coordinator's secret (the one `rollout serve` printed; "
        "default: $ROLLOUT_AUTH_TOKEN, then $ROLLOUT_AUTH_TOKEN_FILE)",
    )
    _add_curve_option(p)
    _add_engine_options(p)
    p.set_defaults(func=engine)


def _token(command: str, args: argparse.Namespace) -> str | None:
    try:
        return resolve_token(token_file=args.auth_token_file)
    except ValueError as e:
        raise SystemExit(f"rollout {command}: {e}") from None


def engine(args: argparse.Namespace) -> int:
    if args.rank < 0:
        raise SystemExit(f"rollout engine: --rank must be >= 0, got {args.rank}")
    token = _token("engine", args)
    _apply_curve(args)
    from rollout.serving.factory import build_engine  # torch: not for the processes spawned
    from rollout.serving.worker import EngineWorker

    built = build_engine(args.model, device=args.device, dtype=args.dtype, **_engine_config(args))
    worker = EngineWorker(built, args.coordinator, args.rank, auth_token=token,
                          block_size=args.block_size, capacity=args.max_requests)  # fmt: skip
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
    if args.max_restarts < 0 or args.restart_backoff < 0:
        raise SystemExit("rollout serve: --max-restarts and --restart-backoff must be >= 0")
    if args.http_port is not None and not 0 <= args.http_port < 65536:
        raise SystemExit(f"rollout serve: --http-port must be in [0, 65535], got {args.http_port}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("rollout serve: --enable-auto-tool-choice needs --tool-call-parser")


def _write_token_file(token: str) -> Path:
    """The token in a new file only this user can read (in a private temp directory)."""
    folder = Path(tempfile.mkdtemp(prefix="rollout-serve-"))  # mode 0700
    path = folder / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def _serve_token(args: argparse.Namespace) -> tuple[str | None, Path | None]:
    """(token, file written for it): --auth-token-file / environment, else a new one."""
    if args.allow_unauthenticated:
        return None, None
    token = _token("serve", args)
    if token is not None:
        return token, None
    token = new_token()
    return token, _write_token_file(token)


class _EngineEvents:
    """Prints the supervisor's engine events; notices when every engine was given up."""

    def __init__(self, dp: int) -> None:
        self.dp = dp
        self.gave_up: set[int] = set()
        self.all_gave_up = threading.Event()

    def __call__(self, kind: str, rank: int, details: dict) -> None:
        if kind == "exited":
            print(f"engine {rank} exited (code {details.get('exitcode')})", flush=True)
        elif kind == "restarted":
            print(f"engine {rank} restarted pid {details['pid']} "
                  f"(restart {details['restarts']})", flush=True)  # fmt: skip
        elif kind == "gave_up":
            print(f"engine {rank} given up after {details.get('restarts', 0)} restart(s)",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.gave_up.add(rank)
            if len(self.gave_up) >= self.dp:
                self.all_gave_up.set()


def serve(args: argparse.Namespace) -> int:
    _check_serve(args)
    http_limits = _http_limits(args) if args.http_port is not None else None  # refused early
    _apply_curve(args)
    launcher = _launcher(args)
    token, token_file = _serve_token(args)
    events = _EngineEvents(args.dp)

    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    from rollout.serving.cluster import EngineCluster  # torch: not for the processes spawned

    cluster = EngineCluster(
        args.dp,
        args.model,
        inference_config=_engine_config(args),
        device=args.device,
        dtype=args.dtype,
        coordinator={"host": args.host, "port": args.port, "policy": args.policy,
                     "alpha": args.alpha, "block_size": args.block_size,
                     "schedule_output_path": args.schedule_log,
                     "allow_unauthenticated": args.allow_unauthenticated},
        auth_token=token,
        weight_sync=False,
        ready_timeout_s=args.ready_timeout,
        restart={"max_restarts": args.max_restarts, "backoff_s": args.restart_backoff,
                 "backoff_max_s": max(30.0, args.restart_backoff)},
        on_event=events,
        **launcher,
    )  # fmt: skip
    try:
        address = cluster.start_coordinator()
        print(f"coordinator {address} pid {cluster.coordinator_process.pid}", flush=True)
        if token_file is not None:
            print(f"auth token file {token_file}", flush=True)
        for rank, proc in enumerate(cluster.start_engines()):
            print(f"engine {rank} pid {proc.pid}", flush=True)
        try:
            cluster.wait_ready()
        except (RuntimeError, TimeoutError, ConnectionError, PermissionError) as e:
            raise SystemExit(f"rollout serve: {e}") from None
        print(f"ready: {args.dp} engine(s) at {address}", flush=True)
        if args.http_port is not None:
            _serve_http(args, address, token, cluster, events, http_limits)
        while cluster.coordinator_process.is_alive() and not events.all_gave_up.is_set():
            cluster.coordinator_process.join(1.0)
        if events.all_gave_up.is_set():
            print("rollout serve: every engine was given up", file=sys.stderr, flush=True)
        else:
            print("rollout serve: coordinator exited", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.close()
        if token_file is not None:
            token_file.unlink(missing_ok=True)
            token_file.parent.rmdir()
        print("rollout serve: stopped", flush=True)


def _http_token(args: argparse.Namespace) -> str | None:
    try:
        if args.http_auth_token_file is not None:
            return read_token_file(args.http_auth_token_file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"rollout serve: --http-auth-token-file: {e}") from None
    return os.environ.get("ROLLOUT_HTTP_TOKEN") or None


def _serve_http(args: argparse.Namespace, address: str, token: str | None,
                cluster: EngineCluster, events: _EngineEvents, limits: tuple) -> None:  # fmt: skip
    """Run the OpenAI-compatible HTTP front end in this process until a signal, the coordinator
    exiting or every engine being given up. uvicorn re-raises the signal it caught once it has
    shut down, which reaches `_raise_interrupt`: HTTP stops first, then engines, coordinator."""
    # function-level: fastapi/uvicorn are the optional 'http' extra
    import uvicorn

    from rollout.serving.factory import tokenizer_from_source
    from rollout.serving.http.app import build_app
    from rollout.serving.http.chat import load_chat_template, special_tokens_of
    from rollout.serving.http.server import KeepBacklog, install_log_rate_limit, uvicorn_config

    work, connections, bodies = limits

    http_token = _http_token(args)
    if http_token is None and not _is_loopback(args.http_host):
        print(f"WARNING: HTTP on {args.http_host} without a bearer token: anyone who can reach "
              "it can generate (set --http-auth-token-file or ROLLOUT_HTTP_TOKEN)",
              file=sys.stderr, flush=True)  # fmt: skip
    is_dir = Path(args.model).is_dir()
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise SystemExit(f"rollout serve: --chat-template: {e}") from None
    else:
        template = load_chat_template(args.model) if is_dir else None
    app = build_app(address, auth_token=token,
                    tokenizer=tokenizer_from_source(None, args.model),
                    model_name=args.served_model_name or args.model, chat_template=template,
                    special_tokens=special_tokens_of(args.model) if is_dir else {},
                    http_token=http_token, logprobs_mode=args.logprobs_mode,
                    limits=work, tool_call_parser=args.tool_call_parser,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    body_limits=bodies,
                    model_source=args.model)  # fmt: skip
    family = socket.AF_INET6 if ":" in args.http_host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so; without it a
    # reused connection waits ~40 ms per request (Nagle against delayed ACKs)
    sock = KeepBacklog(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # see server.py
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.http_host, args.http_port))
    except OSError as e:
        sock.close()
        raise SystemExit(
            f"rollout serve: cannot bind HTTP {args.http_host}:{args.http_port}: {e}"
        ) from None
    sock.listen(2048)  # callers queue from here, before uvicorn accepts: the URL works once printed
    host = f"[{args.http_host}]" if family == socket.AF_INET6 else args.http_host
    server = uvicorn.Server(uvicorn_config(app, connections, log_level="warning", lifespan="on"))
    install_log_rate_limit()

    def watch() -> None:
        while cluster.coordinator_process.is_alive() and not events.all_gave_up.is_set():
            if server.should_exit:
                return
            cluster.coordinator_process.join(0.5)
        server.should_exit = True

    threading.Thread(target=watch, name="http-watch", daemon=True).start()
    print(f"http http://{host}:{sock.getsockname()[1]}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _http_limits(args: argparse.Namespace):  # -> (Limits, ConnectionLimits, body caps)
    """The HTTP limits the flags give; the connection cap leaves descriptors in reserve."""
    from rollout.serving.http.body_limit import parse_body_limits
    from rollout.serving.http.limits import Limits
    from rollout.serving.http.server import ConnectionLimits, connection_cap, raise_fd_limit

    fd_limit = raise_fd_limit()
    cap = connection_cap(args.http_max_connections, fd_limit)
    if cap < args.http_max_connections:
        print(f"WARNING: --http-max-connections {args.http_max_connections} lowered to {cap}: the "
              f"open-file limit is {fd_limit}", file=sys.stderr, flush=True)  # fmt: skip
    try:
        work = Limits(
            max_choices=args.http_max_choices,
            max_logprobs=args.http_max_logprobs,
            max_request_tokens=args.http_max_request_tokens,
            max_inflight_choices=args.http_max_inflight_choices,
            max_inflight_tokens=args.http_max_inflight_tokens,
            max_caller_share=args.http_max_caller_share,
        )
        connections = ConnectionLimits(max_connections=cap,
                                       request_timeout_s=args.http_request_timeout,
                                       write_idle_s=args.http_write_idle_timeout)  # fmt: skip
        return work, connections, parse_body_limits(args.http_max_body)
    except ValueError as e:
        raise SystemExit(f"rollout serve: HTTP limits: {e}") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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
