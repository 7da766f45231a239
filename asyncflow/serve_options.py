"""The options of `asyncflow serve`, read and checked from its command line and environment before
anything heavy is imported: bad input is one line and exit 2.

Tokens never need to be on the command line (where `ps` shows them): `--token-file` or
`ASYNCFLOW_SERVE_TOKEN`, and for `/admin/*` an optional separate `--admin-token-file` or
`ASYNCFLOW_SERVE_ADMIN_TOKEN`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from asyncflow.errors import UserError

TOKEN_ENV = "ASYNCFLOW_SERVE_TOKEN"
ADMIN_TOKEN_ENV = "ASYNCFLOW_SERVE_ADMIN_TOKEN"


@dataclass(frozen=True)
class ServeOptions:
    """What `run_server` needs besides the model folder."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "model"
    token: str | None = None  # required on every route when set
    admin_token: str | None = None  # when set, the only token /admin/* accepts (and valid on every route)
    max_batch: int = 256  # sequences decoded at once
    max_prefill_tokens: int = 8192  # padded prompt tokens one prefill step may take (vLLM's max_num_batched_tokens)
    max_connections: int = 512  # connection threads at once; over it 503 + Retry-After
    max_queued_choices: int = 8192  # choices admitted and not finished, all requests together; over it 429
    read_timeout_s: float = 60.0  # for a request's headers and body together
    max_pause_s: float = 600.0  # a pause ends by itself after this
    weights_root: Path | None = None  # /admin/load_weights reads only folders under it


def add_serve_arguments(serve: argparse.ArgumentParser, path: Callable[[str], Path] = Path) -> None:
    """The `serve` subcommand's flags (defaults are `ServeOptions`'s)."""
    d = ServeOptions()
    serve.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' on every request (required "
                       f"off loopback); visible in `ps`: prefer --token-file or {TOKEN_ENV}")
    serve.add_argument("--token-file", type=path, default=None, help="read the token from this file")
    serve.add_argument("--admin-token-file", type=path, default=None,
                       help=f"a separate token for /admin/* (or {ADMIN_TOKEN_ENV}); it also opens every other route")
    serve.add_argument("--weights-root", type=path, default=None, help="/admin/load_weights reads only folders "
                       "under this one (without it: any folder on loopback, none when bound elsewhere)")
    serve.add_argument("--max-batch", type=int, default=d.max_batch, help=f"most sequences decoded at once (default {d.max_batch})")
    serve.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                       help=f"most padded prompt tokens prefilled in one step (default {d.max_prefill_tokens})")
    serve.add_argument("--max-connections", type=int, default=d.max_connections,
                       help=f"most connections at once; more get 503 (default {d.max_connections})")
    serve.add_argument("--max-queued-choices", type=int, default=d.max_queued_choices,
                       help=f"most choices queued or running, all requests together; more get 429 (default {d.max_queued_choices})")
    serve.add_argument("--read-timeout", type=float, default=d.read_timeout_s,
                       help=f"seconds a client has to send a whole request, headers and body (default {d.read_timeout_s:g})")
    serve.add_argument("--max-pause-s", type=float, default=d.max_pause_s,
                       help=f"an /admin/pause ends by itself after this many seconds (default {d.max_pause_s:g})")


def read_token(value: str | None, file: Path | None, env: Mapping[str, str], env_name: str, flag: str) -> str | None:
    """A token from its flag, its file or its environment variable (in that order; flag and file
    together are refused); an empty or unreadable one is a `UserError`."""
    if value is not None and file is not None:
        raise UserError(f"serve: give {flag} or {flag}-file, not both")
    if file is not None:
        try:
            text = file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"serve: {flag}-file {file}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
        if not text or "\n" in text:
            raise UserError(f"serve: {flag}-file {file}: expected one line holding the token")
        return text
    if value is not None:
        if not value.strip():
            raise UserError(f"serve: {flag} is empty")
        return value.strip()
    if env_name in env:
        if not env[env_name].strip():
            raise UserError(f"serve: {env_name} is set but empty")
        return env[env_name].strip()
    return None


def options_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServeOptions:
    """Check the flags (one line each) and read the tokens; nothing is loaded or bound yet."""
    from asyncflow.serve_http import is_loopback

    env = os.environ if env is None else env
    if not 0 <= args.port <= 65535:
        raise UserError(f"serve: --port {args.port} is not a port number (0-65535)")
    for flag, value in (("--max-batch", args.max_batch), ("--max-prefill-tokens", args.max_prefill_tokens),
                        ("--max-connections", args.max_connections), ("--max-queued-choices", args.max_queued_choices)):
        if value < 1:
            raise UserError(f"serve: {flag} {value} must be at least 1")
    for flag, seconds in (("--read-timeout", args.read_timeout), ("--max-pause-s", args.max_pause_s)):
        if not 0 < seconds <= 86400:
            raise UserError(f"serve: {flag} {seconds:g} must be seconds in (0, 86400]")
    token = read_token(args.token, args.token_file, env, TOKEN_ENV, "--token")
    admin = read_token(None, args.admin_token_file, env, ADMIN_TOKEN_ENV, "--admin-token")
    if not is_loopback(args.host) and token is None:
        raise UserError(f"serve: --host {args.host} is not loopback; a --token is required to serve beyond this "
                        f"machine (--token-file or {TOKEN_ENV})")
    root = args.weights_root
    if root is not None and not root.is_dir():
        raise UserError(f"serve: --weights-root {root} is not a folder")
    return ServeOptions(host=args.host, port=args.port, model_name=args.served_model_name or args.model_dir.resolve().name,
                        token=token, admin_token=admin, max_batch=args.max_batch,
                        max_prefill_tokens=args.max_prefill_tokens, max_connections=args.max_connections,
                        max_queued_choices=args.max_queued_choices, read_timeout_s=args.read_timeout,
                        max_pause_s=args.max_pause_s, weights_root=root.resolve() if root is not None else None)
