"""Shared fixtures: a tiny random Qwen2 (for engine tests), quickly prepared task folders, and one
local Ray for the whole session (`ray_session`, shared by test_ray.py and test_ray_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path

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


@pytest.fixture(scope="module")
def serve_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random arith-shaped model folder (char tokenizer, 2-layer Qwen2): built in a second."""
    from asyncflow.tasks.arith import make_model, make_tokenizer

    out = tmp_path_factory.mktemp("serve") / "tiny-arith"
    tok = make_tokenizer()
    make_model(tok, seed=0, hidden=64).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


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


@pytest.fixture
def one_line_error(capsys: pytest.CaptureFixture[str]):
    """`one_line_error(argv)`: run the CLI in process; assert exit code 2 and exactly one stderr line
    (`asyncflow: error: ...`); return that line."""
    from asyncflow.cli import main

    def run(argv: list[str]) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.endswith("\n") and err.count("\n") == 1, err
        assert err.startswith("asyncflow: error: ")
        return err

    return run
