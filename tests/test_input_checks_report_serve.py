"""`report RUN_DIR` on run files of an unexpected shape, and `serve MODEL_DIR` with a bad folder, host or
port: exit code 2 and one line naming the file (and line or event) or argument, no traceback; serve
checks its address before it loads a model."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncflow.cli import main

TRAIN = {"kind": "train", "step": 1, "samples": 8, "time_s": 2.0, "samples_per_s": 4.0, "reward_mean": 0.5}




def _run_dir(path: Path, metrics: list[Any] | bytes, samples: list[Any] | None = None, trace: Any = None) -> Path:
    path.mkdir()
    (path / "metrics.jsonl").write_bytes(
        metrics if isinstance(metrics, bytes) else "".join(json.dumps(r) + "\n" for r in metrics).encode())
    if samples is not None:
        (path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if trace is not None:
        (path / "trace.json").write_text(json.dumps(trace))
    return path


@pytest.mark.parametrize(
    ("files", "needle"),
    [
        ({"metrics": [TRAIN, [1, 2]]}, "metrics.jsonl: line 2 is not a JSON object"),
        ({"metrics": [{"kind": "train", "step": 1}]}, "metrics.jsonl: line 1: missing 'samples'"),
        ({"metrics": [{**TRAIN, "time_s": "2s"}]}, "metrics.jsonl: line 1: 'time_s' must be a number, got '2s'"),
        ({"metrics": b"\xff\xfe{}\n"}, "metrics.jsonl: line 1 is not UTF-8 text"),
        ({"metrics": [TRAIN], "samples": [{"status": "trained", "behavior_version": 0, "trained_version": "v1"}]},
         "samples.jsonl: line 1: 'trained_version' must be an integer, got 'v1'"),
        ({"metrics": [TRAIN], "samples": [{"status": "trained", "trained_version": 2}]},
         "samples.jsonl: line 1: 'behavior_version' must be an integer, got None"),
        ({"metrics": [TRAIN], "trace": {"traceEvents": [{"ph": "X", "name": "train", "ts": 0, "dur": 1}]}},
         "trace.json: event 0: missing 'tid'"),
        ({"metrics": [TRAIN], "trace": {"traceEvents": [{"ph": "X", "name": "train", "tid": 1, "ts": 0}]}},
         "trace.json: event 0: missing 'dur'"),
        ({"metrics": [TRAIN], "trace": {"traceEvents": [7]}}, "trace.json: event 0 is not a JSON object"),
        ({"metrics": [TRAIN], "trace": "a string"}, "trace.json: not a Chrome trace"),
    ],
)
def test_run_files_of_the_wrong_shape_are_one_line_naming_the_file(
        files: dict[str, Any], needle: str, tmp_path: Path, one_line_error: Any) -> None:
    run = _run_dir(tmp_path / "run", files["metrics"], files.get("samples"), files.get("trace"))
    err = one_line_error(["report", str(run)])
    assert f"{run}/{needle}" in err
    assert not (run / "report.png").exists()


def test_a_report_is_drawn_without_optional_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A train row without `reward_mean` or `samples_per_s`, an eval row without `eval_accuracy` (left
    out) and a trace in Chrome's bare-list form (here empty) still make a report."""
    metrics = [{"kind": "eval", "step": 0}, {"kind": "train", "step": 1, "samples": 8, "time_s": 2.0},
               TRAIN | {"step": 2, "samples": 16, "time_s": 4.0, "reward_mean": 0.75},
               {"kind": "eval", "step": 2, "eval_accuracy": 0.5}]
    run = _run_dir(tmp_path / "run", metrics, [{"status": "trained", "behavior_version": 1, "trained_version": 2.0}],
                   trace=[])
    assert main(["report", str(run)]) == 0
    text = (run / "summary.md").read_text()
    assert "| run | 2 | 16 | 4.0 | 4.00 | 0.500 -> 0.500 | 0.750 | 1.00 / 1 | 0 / 0 / 0 |" in text
    assert (run / "report.png").stat().st_size > 10_000


# ---------------------------------------------------------------------------------------------- serve


def _fake_model_dir(path: Path, tokenizer: dict[str, Any] | None = None) -> Path:
    """A folder that passes the file checks (config with a model_type, an empty but well-formed
    safetensors file, a tokenizer file) without being a loadable model: what runs after must not be
    reached when the address is bad."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    (path / "tokenizer.json").write_text(json.dumps(tokenizer or {}))
    return path


@pytest.fixture()
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("config", "needle"),
    [("{", "config.json:1: malformed JSON"), ("{}", "config.json has no 'model_type'")],
)
def test_serve_a_folder_with_a_bad_config_is_one_line(config: str, needle: str, tmp_path: Path,
                                                      one_line_error: Any) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    err = one_line_error(["serve", str(folder), "--port", "0"])
    assert f"serve MODEL_DIR: {folder}/{needle}" in err


def test_serve_a_port_in_use_is_refused_before_the_model_loads(busy_port: int, tmp_path: Path,
                                                               one_line_error: Any) -> None:
    folder = _fake_model_dir(tmp_path / "m")  # loading it would fail: the port must be checked first
    err = one_line_error(["serve", str(folder), "--port", str(busy_port)])
    assert f"serve: --port {busy_port}: address already in use" in err


def test_serve_an_unresolvable_host_is_refused_before_the_model_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      one_line_error: Any) -> None:
    def no_such_host(*args: Any, **kwargs: Any) -> Any:  # as the resolver answers for an unknown name (no DNS here)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    folder = _fake_model_dir(tmp_path / "m")
    err = one_line_error(["serve", str(folder), "--host", "no-such-host.invalid", "--token", "abc"])
    assert "serve: --host no-such-host.invalid: cannot be resolved (Name or service not known)" in err


def _word_level(vocab: list[str]) -> dict[str, Any]:
    """A minimal `tokenizers` WordLevel tokenizer.json with no special tokens (so no EOS)."""
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(vocab)}, "unk_token": vocab[0]},
    }


def test_serve_a_tokenizer_without_eos_or_that_does_not_load_is_one_line(tmp_path: Path,
                                                                         one_line_error: Any) -> None:
    no_eos = _fake_model_dir(tmp_path / "no-eos", _word_level(["<unk>", "a", "b", "c"]))
    (no_eos / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    err = one_line_error(["serve", str(no_eos), "--port", "0"])
    assert f"serve MODEL_DIR: the tokenizer in {no_eos} has no EOS token" in err
    broken = _fake_model_dir(tmp_path / "broken", {"model": {"type": "NoSuchModel"}})
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    err = one_line_error(["serve", str(broken), "--port", "0"])
    assert f"serve MODEL_DIR: cannot load a tokenizer from {broken}" in err
