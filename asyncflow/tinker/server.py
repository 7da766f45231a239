"""`asyncflow tinker-serve`: the Tinker service over HTTP/1.1 (the standard library's threading server).

Why not `asyncflow serve`'s transport (serve_http): it answers one request per connection with JSON
or server-sent events, while the Tinker SDK keeps connections alive and reads protobuf replies. Here a
thread per connection serves its requests in turn; a `retrieve_future` holds its thread for up to the
futures' poll time (20 s), and a connection idle for `IDLE_S` is closed.
"""

from __future__ import annotations

import http.server
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.errors import UserError
from asyncflow.tinker.service import Reply, TinkerService

if TYPE_CHECKING:
    from asyncflow.tinker.training import TrainingBackend

IDLE_S = 120.0  # a keep-alive connection with no request for this long is closed
MAX_BODY_BYTES = 256 * 2**20


class _Handler(http.server.BaseHTTPRequestHandler):
    server: TinkerHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_S

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 <= length <= MAX_BODY_BYTES:
            reply = Reply(413, b'{"detail": "the body is larger than the server accepts"}')
            self.close_connection = True
        else:
            body = self.rfile.read(length) if length else b""
            if self.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                reply = Reply(400, b'{"detail": "compressed request bodies are not supported"}')
            else:
                headers = {k.lower(): v for k, v in self.headers.items()}
                reply = self.server.service.handle(method, self.path, headers, body)
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def do_DELETE(self) -> None:
        self._answer("DELETE")

    def do_PUT(self) -> None:
        self._answer("PUT")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class TinkerHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # (the SDK opens many connections at once)

    def __init__(self, address: tuple[str, int], service: TinkerService) -> None:
        self.service = service
        super().__init__(address, _Handler)


def start(service: TinkerService, host: str, port: int) -> tuple[TinkerHTTPServer, threading.Thread]:
    """Bind `host:port` (0: a free port; read it from `server.server_address`) and serve in a thread."""
    try:
        server = TinkerHTTPServer((host, port), service)
    except OSError as exc:
        raise UserError(f"tinker-serve: cannot listen on --host {host} --port {port} ({exc.strerror or exc})") from None
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="tinker-http",
                              daemon=True)
    thread.start()
    return server, thread


def make_service(model_dir: Path, *, api_key: str | None = None, max_batch: int = 64,
                 max_staleness: int = 0, state_dir: Path | None = None, device: str = "cpu",
                 training: TrainingBackend | None = None) -> TinkerService:
    """The service over the model folder: its base model for training, its tokenizer for stops;
    `max_staleness` > 0 turns streaming on (`stream.py`); checkpoints in memory, or in files under
    `state_dir` (created if missing); `device` (cpu, cuda, auto) places training on the first GPU and
    the sampling engines spread over all of them. `training`: the training clients, when not the
    folder's model in this process (`TrainingModels`), e.g. `fsdp_training.FSDPTrainingModels`."""
    from asyncflow.data import generation_stop_ids
    from asyncflow.engines.base import pick_device
    from asyncflow.model_folder import check_model_dir
    from asyncflow.tinker.sampling import SamplingPool
    from asyncflow.tinker.stream import StreamState
    from asyncflow.tinker.training import TrainingModels
    from asyncflow.tokenizer import load_tokenizer

    key = "tinker-serve MODEL_DIR"
    if state_dir is not None:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"tinker-serve --state-dir {state_dir}: cannot create the folder: {exc}") from None
    check_model_dir(model_dir, key=key)
    tok = load_tokenizer(model_dir, key=key)
    eos = int(tok.eos_token_id)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else eos)
    try:
        if training is None:
            training = TrainingModels(model_dir, pick_device(device, 0))
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{key}: cannot load the model in {model_dir}: {type(exc).__name__}: {exc}") from None
    sampling = SamplingPool(model_dir, tok, [eos, *generation_stop_ids(model_dir, eos)], pad, max_batch=max_batch,
                            device=device)
    return TinkerService(training, sampling, api_key=api_key, tokenizer_id=str(model_dir.resolve()),
                         stream=StreamState(max_staleness), state_dir=state_dir, model_name=model_dir.name)


def run(model_dir: Path, host: str, port: int, *, log: Callable[[str], None] = print, **options: Any) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); prints one line with the address once listening.
    `options`: `make_service`'s."""
    service = make_service(model_dir, **options)
    api_key, max_staleness = options.get("api_key"), options.get("max_staleness", 0)
    server, thread = start(service, host, port)
    log(f"asyncflow tinker-serve: {model_dir} listening on http://{host}:{server.server_address[1]} "
        f"(base_url for tinker.ServiceClient; api_key: {'the one given' if api_key else 'any tml-... key'}; "
        f"{f'streaming, samplers up to {max_staleness} steps behind' if max_staleness else 'plain loop'})")

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
        service.shutdown()
