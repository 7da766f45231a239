"""Starting `asyncflow serve`: the model folder loaded into an `HFEngine` behind `OpenAIServer`'s
routes (`make_app`), bound and served in a thread (`start_http`), and the command's main loop
(`run_server`), which ends the process when the engine has stopped after an error."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.errors import RunFailed, UserError
from asyncflow.openai_wire import READ_TIMEOUT_S
from asyncflow.serve import OpenAIServer
from asyncflow.serve_http import MAX_CONNECTIONS, ServeHTTPServer, is_loopback, listen, serve_in_thread
from asyncflow.serve_options import ServeOptions


def start_http(app: OpenAIServer, host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
               read_timeout_s: float = READ_TIMEOUT_S) -> tuple[ServeHTTPServer, threading.Thread]:
    """Bind `host:port` (0: a free port; read it from `server.server_address`) and serve in a thread."""
    server = listen(host, port, max_connections=max_connections, read_timeout_s=read_timeout_s)
    server.app = app
    return server, serve_in_thread(server)


MODEL_DIR_KEY = "serve MODEL_DIR"


def load_tokenizer(model_dir: Path) -> Any:
    """The folder's tokenizer; one that does not load, is empty or has no EOS token is a `UserError`
    naming the folder (`asyncflow.tokenizer.load_tokenizer`, under this command's key)."""
    from asyncflow.tokenizer import load_tokenizer as load

    return load(model_dir, key=MODEL_DIR_KEY)


def make_app(model_dir: Path, *, model_name: str, token: str | None, max_batch: int, seed: int = 0,
             options: ServeOptions | None = None) -> OpenAIServer:
    """Load the model folder's tokenizer and weights into an `HFEngine` behind the routes; a folder
    that does not load is a `UserError` naming it. `options` gives the limits (defaults otherwise)."""
    opts = options or ServeOptions()
    tok = load_tokenizer(model_dir)

    import torch

    from asyncflow.data import generation_stop_ids
    from asyncflow.engines.hf import HFEngine
    from asyncflow.model_folder import check_weights_match_config

    check_weights_match_config(model_dir, key=MODEL_DIR_KEY)
    torch.manual_seed(seed)
    try:
        eos = int(tok.eos_token_id)  # (and generation_config.json's stop ids, as transformers and vLLM stop)
        engine = HFEngine(model_dir, eos_token_id=[eos, *generation_stop_ids(model_dir, eos)],
                          pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
                          max_batch=max_batch, seed=seed, name="serve", max_prefill_tokens=opts.max_prefill_tokens)
    except (OSError, ValueError, KeyError) as exc:  # the folder's config or weights (json errors are ValueErrors)
        raise UserError(f"{MODEL_DIR_KEY}: cannot load the model in {model_dir}: {type(exc).__name__}: {exc}") from None
    ctx = getattr(engine.model.config, "max_position_embeddings", None)
    return OpenAIServer(engine, tok, model_name, token=token, max_context=ctx, admin_token=opts.admin_token,
                        max_queued_choices=opts.max_queued_choices, max_pause_s=opts.max_pause_s,
                        weights_root=opts.weights_root, load_anywhere=is_loopback(opts.host))


def run_server(model_dir: Path, opts: ServeOptions, log: Callable[[str], None] = print) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); prints one line with the address once listening.
    An engine that stops after an error (not out of memory: that fails its requests only) ends the
    server with `RunFailed` (exit 1) for its supervisor to restart it; /health says 503 until then.

    The cheap checks run first, in the order that costs least: the folder's files (plain Python), then
    the address (bound now, served once the model is in), then the tokenizer and the model."""
    from asyncflow.model_folder import check_model_dir

    check_model_dir(model_dir, key=MODEL_DIR_KEY)
    server = listen(opts.host, opts.port, max_connections=opts.max_connections, read_timeout_s=opts.read_timeout_s)
    try:
        app = make_app(model_dir, model_name=opts.model_name, token=opts.token, max_batch=opts.max_batch, options=opts)
    except BaseException:
        server.server_close()
        raise
    server.app = app
    thread = serve_in_thread(server)
    bound_port = int(server.server_address[1])
    log(f"asyncflow serve: model {opts.model_name!r} from {model_dir} listening on http://{opts.host}:{bound_port}"
        + (" (token required)" if opts.token else ""))

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        watch_engine(app, thread)
    finally:
        server.shutdown()
        server.server_close()
        app.engine.shutdown()


def watch_engine(app: OpenAIServer, thread: threading.Thread, poll_s: float = 0.5) -> None:
    """Return when the HTTP thread ends; raise `RunFailed` once the engine stopped after an error."""
    while thread.is_alive():
        error = getattr(app.engine, "error", None)
        if error is not None:
            raise RunFailed(f"serve: the engine stopped after an error ({type(error).__name__}: {error}); exiting "
                            "so that a supervisor restarts the server")
        thread.join(timeout=poll_s)
