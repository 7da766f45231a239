"""Shared fixtures: a tiny random Qwen2 (for engine tests), quickly prepared task folders, the real
SmolLM2-135M-Instruct folder that scripts/test.sh prepares once (`smollm2_dir`), and one local Ray for
the whole session (`ray_session`, shared by test_ray.py and test_ray_faults.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Ray on Linux rewrites 127.0.0.1 to the machine's interface address unless this is 0 (read when ray
# is imported): every Ray node, driver and GCS of the suite stays on loopback
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def tiny_model():
    """A random 2-layer Qwen2 over a 32-token vocabulary (eos=1, pad=0), float32, eval mode."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def arith_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The arith task pack prepared with a short warm start (fast; accuracy is not the point)."""
    from asyncflow.tasks.arith import prepare

    return prepare(tmp_path_factory.mktemp("arith") / "arith-quick", seed=0, sft_steps=30)


@pytest.fixture(scope="session")
def calc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The calc task pack prepared with a short warm start (fast; tool use is not learned yet)."""
    from asyncflow.tasks import calc

    return calc.cached_prepare(tmp_path_factory.mktemp("calc-cache"), seed=0, sft_steps=30)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct Hugging Face folder in $ASYNCFLOW_SMOLLM2_DIR, which scripts/test.sh
    prepares once into a cache that outlives the run: tests never download. Unset or missing fails
    the test (a slow test that silently skipped would hide that the suite did not run it)."""
    value = os.environ.get("ASYNCFLOW_SMOLLM2_DIR", "")
    if not value or not (Path(value) / "config.json").is_file():
        pytest.fail(f"ASYNCFLOW_SMOLLM2_DIR is {'unset' if not value else repr(value) + ', which holds no model'}: "
                    "run the tests with scripts/test.sh (it prepares the model once), or run "
                    "`asyncflow prepare smollm2 --out DIR` and export ASYNCFLOW_SMOLLM2_DIR=DIR", pytrace=False)
    return Path(value)


@pytest.fixture(scope="module")
def serve_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random arith-shaped model folder (char tokenizer, 2-layer Qwen2): built in a second."""
    from asyncflow.tasks.arith import make_model, make_tokenizer

    out = tmp_path_factory.mktemp("serve") / "tiny-arith"
    tok = make_tokenizer()
    make_model(tok, seed=0, hidden=64).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


class InProcessServer:
    """An in-process `asyncflow serve` on a free loopback port, with `ServeOptions` limits."""

    def __init__(self, model_dir: Path, **limits: Any) -> None:
        from asyncflow.serve_main import make_app, start_http
        from asyncflow.serve_options import ServeOptions

        opts = ServeOptions(**limits)
        self.app = make_app(model_dir, model_name="tiny", token=opts.token, max_batch=opts.max_batch, options=opts)
        self.http, self.thread = start_http(self.app, "127.0.0.1", 0, max_connections=opts.max_connections,
                                            read_timeout_s=opts.read_timeout_s)
        self.port = int(self.http.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.app.engine.shutdown()


@pytest.fixture()
def make_server(serve_dir: Path) -> Iterator[Callable[..., InProcessServer]]:
    """make_server(**limits): an in-process server on `serve_dir`'s model, closed after the test."""
    made: list[InProcessServer] = []

    def make(**limits: Any) -> InProcessServer:
        made.append(InProcessServer(serve_dir, **limits))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="session")
def train_batch() -> Callable[..., Any]:
    """train_batch(n, seed): a toy train batch of n rows (ids < 32, lengths 1-7) for engine tests."""
    import torch

    from asyncflow.workflow.batch import build_train_batch

    def make(n: int = 6, seed: int = 0) -> Any:
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, 32, (3 + i % 3,), generator=g).tolist() for i in range(n)]
        responses = [torch.randint(2, 32, (1 + (i * 5) % 7,), generator=g).tolist() for i in range(n)]
        behavior = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
        return build_train_batch(prompts, responses, behavior, torch.randn(n, generator=g), [True] * n, 0)

    return make


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (2 CPUs) for the whole pytest session, shut down at its end if this started it."""
    import ray

    from asyncflow.runtime.ray_init import ensure_ray

    started = not ray.is_initialized()
    ensure_ray(None, num_cpus=2)
    yield ray
    if started:
        ray.shutdown()


def _ray_daemon(line: str) -> bool:
    """A log line that Ray forwards from its daemons (`(raylet) ...`, `(gcs_server) ...`, colour or not)."""
    return line.lstrip("\x1b[0123456789;m").startswith(("(raylet)", "(gcs_server)"))


@pytest.fixture
def one_line_error(capsys: pytest.CaptureFixture[str]):
    """`one_line_error(argv)`: run the CLI in process; assert exit code 2 and exactly one stderr line
    (`asyncflow: error: ...`); return that line."""
    from asyncflow.cli import main

    def run(argv: list[str]) -> str:
        assert main(argv) == 2
        # (a Ray session an earlier test left up prints its daemons' warnings, e.g. a nearly full disk,
        # to this process's stderr at any time: those lines are Ray's, not the CLI's)
        err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True) if not _ray_daemon(line))
        assert err.endswith("\n") and err.count("\n") == 1, err
        assert err.startswith("asyncflow: error: ")
        return err

    return run
