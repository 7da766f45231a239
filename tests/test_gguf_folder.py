"""GGUF files: the conversion into a Hugging Face folder (on a tiny Llama GGUF written here with the
gguf package's GGUFWriter: F32, Q8_0 and Q4_0 tensors and a BPE tokenizer in its metadata), the
cache a `.gguf` model.path is converted into, and the bad-input paths of both."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncflow.atomic_files import create_dir_atomic
from asyncflow.errors import UserError

REPO = Path(__file__).resolve().parent.parent
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, Any]:
    """A 2-layer Llama (hidden 64, 32 tokens, tied embeddings) as a GGUF file: attention in Q8_0, the
    MLP's gate and up in Q4_0, everything else F32. Returns the float arrays written, by GGUF name."""
    import gguf
    import numpy as np

    rng, q = np.random.default_rng(seed), gguf.GGMLQuantizationType
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *"abcdefghij", "Ġ", "Ċ", "ab", "cd"]
    tokens += [f"<extra{i}>" for i in range(32 - len(tokens))]
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 2), (w.add_context_length, 128), (w.add_embedding_length, 64),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_dimension_count, 16), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_vocab_size, len(tokens)), (w.add_tokenizer_model, "gpt2"), (w.add_token_list, tokens),
                       (w.add_token_types, [3, 3, 3] + [1] * (len(tokens) - 3)), (w.add_token_merges, ["a b", "c d"]),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_add_bos_token, False),
                       (w.add_chat_template, CHATML)):
        add(value)  # type: ignore[operator]
    written = {}
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
              "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128), "attn_norm": (64,), "ffn_norm": (64,)}
    names = [("token_embd.weight", (len(tokens), 64)), ("output_norm.weight", (64,))]
    names += [(f"blk.{i}.{n}.weight", s) for i in range(2) for n, s in shapes.items()]
    for name, shape in names:
        a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        kind = q.Q8_0 if ".attn_" in name and "norm" not in name else \
            q.Q4_0 if "ffn_gate" in name or "ffn_up" in name else None
        written[name] = a if kind is None else gguf.dequantize(gguf.quantize(a, kind), kind).reshape(shape)
        w.add_tensor(name, a) if kind is None else w.add_tensor(name, gguf.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


def test_a_tiny_gguf_converts_to_a_plain_folder_that_loads_saves_and_chats(tiny_gguf: tuple[Path, dict[str, Any]],
                                                                           tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncflow.gguf_folder import convert_gguf
    from asyncflow.model_folder import check_model_dir, check_weights_match_config

    path, written = tiny_gguf
    out = tmp_path / "tiny"
    assert create_dir_atomic(out, lambda folder: convert_gguf(path, folder, log=lambda line: None))
    check_model_dir(out)
    check_weights_match_config(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert (config["model_type"], config["tie_word_embeddings"], config["vocab_size"]) == ("llama", True, 32)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    state = model.state_dict()
    for gguf_name, hf_name in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),      # F32
                               ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),         # Q4_0
                               ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight")):  # Q8_0
        assert torch.equal(state[hf_name], torch.from_numpy(written[gguf_name])), hf_name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(str(tmp_path / "saved-again"))  # (a model loaded from the GGUF itself refuses)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.eos_token, tok.eos_token_id, tok.decode(tok("abc")["input_ids"])) == ("<|im_end|>", 2, "abc")
    text = tok.apply_chat_template([{"role": "user", "content": "ab"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / "asyncflow_source.json").read_text())["gguf"] == path.name


def test_a_gguf_is_converted_once_into_the_cache_keyed_by_its_content(
        tiny_gguf: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow import gguf_folder

    path, _ = tiny_gguf
    lines: list[str] = []
    first = gguf_folder.cached_folder(path, tmp_path / "cache", lines.append)
    assert first.parent == tmp_path / "cache" / "gguf" and any("converted in" in line for line in lines)
    copy = tmp_path / "renamed copy.gguf"
    shutil.copy(path, copy)

    def no_conversion(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_folder, "convert_gguf", no_conversion)
    assert gguf_folder.cached_folder(copy, tmp_path / "cache", lines.append) == first
    monkeypatch.undo()
    write_tiny_gguf(copy, seed=1)  # (the same size and name, other weights: another folder)
    assert gguf_folder.cached_folder(copy, tmp_path / "cache", lines.append) != first
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.name.startswith(".")]


def test_create_dir_atomic_leaves_nothing_when_filling_fails_and_never_replaces_a_full_folder(tmp_path: Path) -> None:
    def fail(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        create_dir_atomic(tmp_path / "a" / "out", fail)
    assert list((tmp_path / "a").iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "theirs").write_text("x")
    assert not create_dir_atomic(tmp_path / "full", lambda folder: (folder / "mine").write_text("y"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["theirs"]


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("missing.gguf", None, "model.path: {p} does not exist"),
    ("bad.gguf", b"PK\x03\x04 a zip, not a gguf", "model.path: {p} is not a GGUF file (it starts with b'PK\\x03\\x04'"),
    ("folder.gguf", "dir", "model.path: {p} is a folder, not a GGUF file"),
])
def test_a_bad_gguf_model_path_is_one_line_before_torch_is_imported(tmp_path: Path, name: str, content: Any,
                                                                   expected: str) -> None:
    p = tmp_path / name
    if content == "dir":
        p.mkdir()
    elif content is not None:
        p.write_bytes(content)
    (tmp_path / "run.yaml").write_text(f"task: arith\nmodel: {{path: {json.dumps(str(p))}}}\n")
    probe = ("import sys; from asyncflow.cli import main; rc = main(['train', sys.argv[1], '--out', sys.argv[2]]); "
             "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "run.yaml"), str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    err = done.stderr
    assert err.count("\n") == 1 and err.startswith(f"asyncflow: error: {expected.format(p=p)}"), err
    assert not (tmp_path / "run").exists()


def test_a_gguf_without_the_gguf_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          one_line_error: Any) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # (find_spec answers None, as when it is not installed)
    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (tmp_path / "run.yaml").write_text(f"task: arith\nmodel: {{path: {json.dumps(str(tmp_path / 'm.gguf'))}}}\n")
    line = one_line_error(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")])
    assert line == "asyncflow: error: model.path: reading a GGUF file needs the gguf package: " \
                   "pip install 'asyncflow[gguf]'\n"
    line = one_line_error(["prepare", "smollm2", "--out", str(tmp_path / "smollm2")])
    assert "prepare smollm2: reading a GGUF file needs the gguf package: pip install 'asyncflow[gguf]'" in line
    assert not (tmp_path / "smollm2").exists()


def test_a_gguf_transformers_cannot_read_is_one_line_naming_model_path(tmp_path: Path) -> None:
    from asyncflow.gguf_folder import convert_gguf

    bad = tmp_path / "header-only.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 16)  # (no tensors, no metadata)
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"^model.path: .*header-only.gguf: transformers cannot convert this GGUF "):
        convert_gguf(bad, tmp_path / "out", log=lambda line: None)


@pytest.mark.slow
def test_a_run_with_a_gguf_model_path_trains_its_converted_folder_and_saves_final(
        tiny_gguf: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    from asyncflow.config import load_config
    from asyncflow.runner import train

    path, _ = tiny_gguf
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": "ab" * (1 + i % 7), "solution": "c"}) + "\n"
                                                 for i in range(70)))
    (tmp_path / "gguf_rewards.py").write_text("def score(prompts, completions, solution, **kw):\n"
                                              "    return [float(c.startswith(s)) for c, s in zip(completions, solution)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, _ = load_config(None, ["task=null", f"model.path={path}", f"model.cache_dir={tmp_path / 'cache'}",
                                f"dataset.path={tmp_path / 'data.jsonl'}", "dataset.label_key=solution",
                                "reward.fn=gguf_rewards:score", "train.max_steps=2", "train.batch_size=8", "rollout.n=4",
                                "rollout.max_new_tokens=4", "eval.size=4", "logging.progress=false"])
    summary = train(cfg, tmp_path / "run", progress_enabled=False)
    assert summary["samples"] == 16
    [converted] = (tmp_path / "cache" / "gguf").iterdir()
    assert json.loads((converted / "asyncflow_source.json").read_text())["gguf"] == path.name
    final = tmp_path / "run" / "final"
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    AutoModelForCausalLM.from_pretrained(str(final))
