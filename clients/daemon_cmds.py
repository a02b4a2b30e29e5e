"""`ahead serve`, `ahead status` and `ahead stop`."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import time
from typing import Any

from clients.common import CliError, add_model_args, load_engine, model_dir
from daemon.config import BACKENDS, FIM_TEMPLATES

log = logging.getLogger("ahead.daemon")


def cmd_serve(args: argparse.Namespace) -> int:
    started = time.perf_counter()  # load_s "imports": to the model's load (torch with it)
    from daemon import log as daemon_log
    from daemon import paths
    from daemon.config import config_path
    from daemon.instance import AlreadyRunning, InstanceLock
    from daemon.server import Server

    lock = InstanceLock(paths.lock_path())
    try:
        lock.acquire()  # before the slow model load: a second daemon fails at once
    except AlreadyRunning as e:
        print(f"ahead: error: {e} on {paths.socket_path()}", file=sys.stderr)
        return 1
    cfg = serve_settings(args)
    log_handler = daemon_log.setup(paths.state_dir() / "daemon.log", cfg.log_max_bytes,
                                   to_stderr=args.ready_fd is None)
    try:
        http = _http_endpoint(cfg.http, args.no_auth) if cfg.http else None
        backend, name = _remote(cfg) if cfg.backend == "openai" else _local(args, cfg, started)
    except ValueError as e:
        raise CliError(str(e)) from None
    idle = cfg.idle_timeout if args.idle_timeout is None else args.idle_timeout
    server = Server(backend, paths.socket_path(), lock, model_name=name, idle_timeout=idle,
                    stats_path=paths.state_dir() / "stats.json",
                    watch_debounce_ms=None if args.no_watch else 1500,
                    config_file=config_path(), http=http)
    server.requests.min_confidence = cfg.min_confidence

    def ready() -> None:
        if args.ready_fd is not None:  # started by a client: say so, then detach from it
            os.write(args.ready_fd, b"ready\n")
            log_handler.follow(args.ready_fd, 1, 2)

    asyncio.run(server.serve(on_ready=ready))
    return 0


SETTING_FLAGS = ("backend", "url", "served_model", "api_key_env", "fim_template", "tokenizer",
                 "http", "max_seq_len")


def serve_settings(args: argparse.Namespace) -> Any:
    """The config file's settings and AHEAD_* variables, with the flags given over them."""
    import dataclasses

    from daemon.config import ConfigFileError, load_settings

    flags = {f: getattr(args, f) for f in SETTING_FLAGS if getattr(args, f, None) is not None}
    try:
        return dataclasses.replace(load_settings(), **flags)
    except ConfigFileError as e:
        raise CliError(str(e)) from None


def _local(args: argparse.Namespace, cfg: Any, started: float) -> tuple[Any, str]:
    from daemon import paths
    from daemon.backends.local import LocalBackend

    importlib.import_module("engine")  # and torch (on the H200, ~9 s before loading began)
    imports = time.perf_counter() - started
    _set_threads(cfg.threads if args.threads is None else args.threads)
    engine = load_engine(args)
    engine.load_seconds = {"imports": imports} | engine.load_seconds

    def loader(path: Any) -> Any:  # the same flags, another model directory
        return load_engine(argparse.Namespace(**{**vars(args), "model": str(path)}))

    path = model_dir(args)
    return LocalBackend(engine, loader=loader, model_dir=path,
                        policy_dir=paths.state_dir()), str(path)


def _remote(cfg: Any) -> tuple[Any, str]:
    from daemon.backends.openai import OpenAIBackend

    backend = OpenAIBackend.from_settings(cfg)
    log.info("backend: %s (prompts: %s)", backend.url, backend.prompts.description)
    return backend, cfg.served_model or backend.url


def _http_endpoint(spec: str, no_auth: bool) -> Any:
    from daemon import paths
    from daemon.http import HttpEndpoint, token

    if no_auth:
        return HttpEndpoint.parse(spec, None)
    path = paths.http_token_path()
    endpoint = HttpEndpoint.parse(spec, token(path))
    log.info("the HTTP endpoint's bearer token is in %s", path)
    return endpoint


def _set_threads(threads: int) -> None:
    """The model's CPU threads in the daemon. By default all cores but one: the daemon's
    event loop wakes at every step to stream it, and a core it takes from the model's
    threads stalls each parallel op until the preempted thread runs again (on 2 cores, the
    daemon decodes about a third faster with one model thread than with two). An explicit
    OMP_NUM_THREADS is left as it is."""
    import torch

    if threads < 0:
        raise CliError(f"threads must not be negative, got {threads}")
    if threads:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    log.info("model threads: %d", torch.get_num_threads())


def cmd_status(args: argparse.Namespace) -> int:
    from daemon.client import Client, DaemonUnavailable

    async def ask() -> dict:
        client = Client(autostart=False)
        try:
            return await client.status()
        finally:
            await client.close()

    try:
        info = asyncio.run(ask())
    except DaemonUnavailable as e:
        print(f"ahead: no daemon running ({e})", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:>18}: {value}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop the daemon and wait until it has let go of its socket; none running is fine."""
    from daemon.client import Client, DaemonUnavailable

    async def stop() -> bool:
        client = Client(autostart=False)
        try:
            await client.connect()
        except DaemonUnavailable:
            return False
        await client.shutdown()
        try:
            await client.wait_closed(30)
        finally:
            await client.close()
        return True

    if not asyncio.run(stop()):
        print("ahead: no daemon running", file=sys.stderr)
    return 0


def add_parsers(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the daemon that keeps the model resident")
    add_model_args(serve)
    serve.add_argument("--idle-timeout", type=float,
                       help="exit after this many idle seconds (0: never; default 1800)")
    serve.add_argument("--threads", type=int,
                       help="CPU threads for the model (default: all cores but one)")
    serve.add_argument("--no-watch", action="store_true",
                       help="do not reload when the model directory changes")
    serve.add_argument("--backend", choices=BACKENDS,
                       help="local: the model in this process (default); openai: a remote "
                       "OpenAI-compatible server (vLLM, SGLang, llama-server) at --url")
    serve.add_argument("--url", help="the remote server's API, e.g. http://gpu-box:8000/v1")
    serve.add_argument("--served-model", help="the model name the server serves")
    serve.add_argument("--api-key-env", help="environment variable holding its API key")
    serve.add_argument("--tokenizer", help="directory of the served model's tokenizer.json "
                       "(the daemon builds the FIM prompts; default: --served-model's in "
                       "the Hugging Face cache)")
    serve.add_argument("--fim-template",
                       choices=FIM_TEMPLATES, help="without a tokenizer: the served model's "
                       "FIM layout; infill: llama-server's /infill builds the prompt")
    serve.add_argument("--http", metavar="HOST:PORT",
                       help="also serve an OpenAI-compatible HTTP endpoint (e.g. "
                       "127.0.0.1:8741); off by default")
    serve.add_argument("--no-auth", action="store_true",
                       help="the HTTP endpoint without a bearer token (loopback only)")
    serve.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)
    status = sub.add_parser("status", help="what the daemon is doing, and its statistics")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)
    stop = sub.add_parser("stop", help="stop the daemon (editors and commands restart it)")
    stop.set_defaults(func=cmd_stop)
