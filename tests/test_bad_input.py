"""Bad input through the real CLI: exit code 2, one line on stderr naming the key, file or row, no traceback.

Each case runs `python -m asyncflow ...` in a fresh process. The cases that need no tokenizer are also
run together in one process through `asyncflow.cli.main`, which then checks that none of them
imported torch, transformers or ray (validation comes before the heavy imports). Per-call reward
failures (raises, wrong length, NaN, None, non-numbers) do not stop a run: tests/test_rewards.py and
tests/test_workflow.py cover them.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncflow.errors import UserError

REPO = Path(__file__).resolve().parent.parent


def write_safetensors(path: Path, *, truncate: int = 0) -> None:
    """A one-tensor safetensors file written byte by byte (no torch); `truncate` drops trailing bytes."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    blob = struct.pack("<Q", len(header)) + header + b"\0" * 8
    path.write_bytes(blob[: len(blob) - truncate])


def make_model_dir(path: Path, *, config: str | None = '{"model_type": "qwen2"}', weights: str = "ok",
                   tokenizer: str | None = "{not json") -> Path:
    """A model folder as far as file checks go: config.json, weights and a tokenizer.json (by default
    one that cannot load)."""
    path.mkdir(parents=True)
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(tokenizer)
    if config is not None:
        (path / "config.json").write_text(config)
    if weights == "ok":
        write_safetensors(path / "model.safetensors")
    elif weights == "truncated":
        write_safetensors(path / "model.safetensors", truncate=3)
    elif weights == "garbage":
        (path / "model.safetensors").write_bytes(b"not a safetensors file at all")
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of good and bad inputs that the cases below point at (relative paths: it is the cwd)."""
    d = tmp_path_factory.mktemp("bad-input")
    make_model_dir(d / "model")  # passes the file checks; its tokenizer cannot load
    make_model_dir(d / "no_tokenizer", tokenizer=None)
    make_model_dir(d / "no_config", config=None)
    make_model_dir(d / "bad_config", config='{"model_type": ')
    make_model_dir(d / "no_weights", weights="none")
    make_model_dir(d / "truncated", weights="truncated")
    make_model_dir(d / "garbage", weights="garbage")
    (d / "not_a_dir").write_text("x")
    (d / "good.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 20)
    (d / "empty.jsonl").write_text("\n")
    (d / "bad_line.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": oops}\n')
    # a good row and a blank line first: messages name the file's line (3), not the row's index (1)
    (d / "no_prompt.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"question": "1+1=", "answer": "2"}\n')
    (d / "rewards_ok.py").write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    (d / "rewards_broken.py").write_text("import not_a_module_anywhere\n")
    (d / "rewards_exits.py").write_text("import sys\nsys.exit(0)  # a script guard: asyncflow ended, exit 0, no word\n")
    (d / "malformed.yaml").write_text("train:\n  lr: [1, 2\n")
    (d / "typo.yaml").write_text("rollout:\n  tempreature: 0.5\n")
    (d / "list.yaml").write_text("- train\n")
    (d / "empty.yaml").write_text("\n")  # (a file cut short: it ran the 600-step default job)
    (d / "empty_prompt.jsonl").write_text('{"prompt": "", "answer": "2"}\n')
    (d / "bad_message.jsonl").write_text('{"prompt": [{"foo": 1}], "answer": "2"}\n')
    (d / "latin1.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    (d / "dup.yaml").write_text("train:\n  lr: 0.1\n  lr: 0.2\n")
    (d / "latin1.yaml").write_bytes(b"seed: 1\n# caf\xe9\n")
    (d / "section.yaml").write_text("train: 5\n")
    (d / "complex_key.yaml").write_text("? [a, b]\n: 1\n")
    (d / "old_run").mkdir()
    (d / "old_run" / "config.yaml").write_text("seed: 0\n")
    for name, model, data, reward in [
        ("missing_model", "nowhere", "good.jsonl", "rewards_ok:score"),
        ("not_a_dir", "not_a_dir", "good.jsonl", "rewards_ok:score"),
        ("no_config", "no_config", "good.jsonl", "rewards_ok:score"),
        ("bad_config", "bad_config", "good.jsonl", "rewards_ok:score"),
        ("no_weights", "no_weights", "good.jsonl", "rewards_ok:score"),
        ("truncated", "truncated", "good.jsonl", "rewards_ok:score"),
        ("garbage", "garbage", "good.jsonl", "rewards_ok:score"),
        ("no_tokenizer", "no_tokenizer", "good.jsonl", "rewards_ok:score"),
        ("missing_data", "model", "nothing.jsonl", "rewards_ok:score"),
        ("empty_data", "model", "empty.jsonl", "rewards_ok:score"),
        ("bad_line", "model", "bad_line.jsonl", "rewards_ok:score"),
        ("no_prompt", "model", "no_prompt.jsonl", "rewards_ok:score"),
        ("empty_prompt", "model", "empty_prompt.jsonl", "rewards_ok:score"),
        ("bad_message", "model", "bad_message.jsonl", "rewards_ok:score"),
        ("latin1_data", "model", "latin1.jsonl", "rewards_ok:score"),
        ("reward_broken", "model", "good.jsonl", "rewards_broken:score"),
        ("reward_missing_fn", "model", "good.jsonl", "rewards_ok:nope"),
        ("reward_exits", "model", "good.jsonl", "rewards_exits:score"),
        ("reward_file_exits", "model", "good.jsonl", "rewards_exits.py:score"),
        ("tokenizer", "model", "good.jsonl", "rewards_ok:score"),
    ]:
        (d / f"{name}.yaml").write_text(
            f"task: null\nmodel: {{path: {model}}}\ndataset: {{path: {data}}}\nreward: {{fn: '{reward}'}}\n"
            "logging: {progress: false}\n"
        )
    return d


# (argv, what the one line must contain); all fail before torch, transformers or ray load
LIGHT_CASES: list[tuple[list[str], str]] = [
    (["train", "malformed.yaml"], "malformed.yaml: line 3:"),
    (["train", "typo.yaml"], "rollout.tempreature: unknown key (did you mean 'temperature'?)"),
    (["train", "list.yaml"], "list.yaml: expected a mapping of config sections"),
    (["train", "empty.yaml"], "empty.yaml: the config file is empty"),
    (["train", "absent.yaml"], "absent.yaml: config file not found"),
    (["train", "model"], "model: is a folder; give the config's YAML file"),
    (["demo", "--set", "train.lr=fast"], "train.lr: expected a number, got 'fast'"),
    (["demo", "--set", "rollout.temprature=0.5"], "rollout.temprature: unknown key (did you mean 'temperature'?)"),
    (["demo", "--set", "workflow.mode=sync", "--set", "workflow.max_staleness=2"],
     "workflow.max_staleness: 2 contradicts workflow.mode=sync"),
    (["demo", "--set", "train.batch_size=12"], "train.batch_size: 12 is not divisible by rollout.n"),
    (["demo", "--set", "nonsense"], "--set 'nonsense': expected key.path=value"),
    (["train", "missing_model.yaml"], "model.path: nowhere does not exist"),
    (["train", "not_a_dir.yaml"], "model.path: not_a_dir is a file, not a Hugging Face model folder"),
    (["train", "no_config.yaml"], "model.path: no_config is not a Hugging Face model folder (no config.json)"),
    (["train", "bad_config.yaml"], "model.path: bad_config/config.json:1: malformed JSON"),
    (["train", "no_weights.yaml"], "model.path: no_weights has no weights"),
    (["train", "truncated.yaml"], "model.path: truncated/model.safetensors is corrupt or truncated"),
    (["train", "garbage.yaml"], "model.path: garbage/model.safetensors is corrupt"),
    (["train", "no_tokenizer.yaml"], "model.path: no_tokenizer has no tokenizer (tokenizer.json"),
    (["train", "missing_data.yaml"], "dataset.path: nothing.jsonl does not exist"),
    (["train", "empty_data.yaml"], "empty.jsonl: the dataset is empty"),
    (["train", "bad_line.yaml"], "bad_line.jsonl:3: malformed JSON"),
    (["train", "no_prompt.yaml"], "no_prompt.jsonl, line 3 has no column 'prompt' (dataset.prompt_key)"),
    (["train", "reward_broken.yaml"], "reward.fn: cannot import module 'rewards_broken': ModuleNotFoundError"),
    (["train", "reward_exits.yaml"], "reward.fn: cannot import module 'rewards_exits': SystemExit"),
    (["train", "reward_file_exits.yaml"], "rewards_exits.py': SystemExit"),
    (["train", "reward_missing_fn.yaml"], "reward.fn: module 'rewards_ok' has no function 'nope'"),
    # a setting that would do nothing: a plain function is called one batch at a time
    (["train", "tokenizer.yaml", "--set", "reward.concurrency=8"],
     "reward.concurrency: applies to an async def reward function; rewards_ok:score is a plain function"),
    (["train", "empty_prompt.yaml"], "empty_prompt.jsonl, line 1: column 'prompt' is empty"),
    (["train", "bad_message.yaml"], "bad_message.jsonl, line 1: column 'prompt' message 0 needs a text 'role' and 'content'"),
    (["train", "latin1_data.yaml"], "latin1.jsonl:2: not UTF-8 text"),
    (["train", "dup.yaml"], "dup.yaml: line 3: key 'lr' is given twice in one section"),
    (["train", "latin1.yaml"], "latin1.yaml: not UTF-8 text"),
    # nan and inf pass every bound (nan < lo is False); an infinite timeout is no timeout
    (["demo", "--set", "train.lr=nan"], "train.lr: expected a finite number, got 'nan'"),
    (["demo", "--set", "workflow.step_timeout_s=.inf"], "workflow.step_timeout_s: expected a finite number"),
    (["demo", "--set", "seed=99999999999999999999999"], "seed: 99999999999999999999999 is above the maximum"),
    (["demo", "--out", "good.jsonl/run"], "--out: good.jsonl/run lies under"),
    (["prepare", "arith", "--out", "good.jsonl"], "--out: good.jsonl is a file, not a folder"),
    (["prepare", "arith", "--seed", "-1", "--out", "p"], "--seed: -1 is outside 0 to 2^31-1"),
    (["prepare", "arith", "--seed", "99999999999999999999999", "--out", "p"], "--seed: 99999999999999999999999 is outside"),
    (["demo", "--set", "model.cache_dir=good.jsonl", "--set", "model.task_seed=1"],
     "model.cache_dir: good.jsonl is a file, not a folder"),
    (["demo", "--set", "model.task_seed=1", "--set", "model.path=."], "model.task_seed: not used with model.path set"),
    (["demo", "--set", "eval.min_delta=0.1", "--set", "eval.patience=0"], "eval.min_delta: not used while eval.patience is 0"),
    (["demo", "--set", "eval.every=0"], "eval.patience: needs eval.every > 0"),
    (["demo", "--out", "old_run"], "--out: old_run already holds a run (with no complete checkpoint to go on from); "
                                    "choose another folder"),
    (["demo", "--out", "good.jsonl"], "--out: good.jsonl is a file, not a folder"),
    # an unset shell variable: `--out ""` used to write the run into the current folder
    (["demo", "--out", ""], "argument --out: an empty path (an unset shell variable?)"),
    # accepted, these grew memory for minutes with Ctrl-C ignored, or ended in a traceback
    (["demo", "--set", "train.batch_size=1073741824"], "train.batch_size: 1073741824 is above the maximum 1048576"),
    (["demo", "--set", "rollout.workers=100000"], "rollout.workers: 100000 is above the maximum 4096"),
    (["demo", "--set", "runtime.torch_threads=100000000000"], "runtime.torch_threads: 100000000000 is above the maximum"),
    # (accepted, they failed the run with a traceback: gc.set_threshold takes a C int, torch a float32 lr)
    (["demo", "--set", "workflow.gc_threshold=10000000000000"], "workflow.gc_threshold: 10000000000000 is above the maximum"),
    (["demo", "--set", "train.lr=1e38"], "train.lr: 1e+38 is above the maximum 10.0"),
    (["demo", "--set", "train.weight_decay=1e300"], "train.weight_decay: 1e+300 is above the maximum 10.0"),
    (["demo", "--set", "workflow.lease_timeout_s=0.001"], "workflow.lease_timeout_s: 0.001 is below the minimum 1.0"),
    (["demo", "--set", "reward.timeout_s=1" + "0" * 400], "reward.timeout_s: expected a finite number, got an integer of 401"),
    # accepted, and read by nothing (an episode is scored by its environment)
    (["demo", "--set", "rollout.env=calculator", "--set", "reward.concurrency=8"], "reward.concurrency: not used with rollout.env"),
    # a --set into a section the file gives as a number replaced it silently
    (["train", "section.yaml", "--set", "train.max_steps=1"], "train: expected a mapping, got 5"),
    (["train", "complex_key.yaml"], "complex_key.yaml: line 1: a key must be a plain value, got list"),
    (["train", "tokenizer.yaml", "--set", "rollout.engine=openai", "--set", "rollout.server_urls=[http://127.0.0.1:99999]"],
     "rollout.server_urls: 'http://127.0.0.1:99999': Port out of range 0-65535"),
    (["train", "tokenizer.yaml", "--set", "rollout.engine=openai", "--set", "rollout.server_urls=[http://127.0.0.1:8000]",
      "--set", "rollout.sync_dir=good.jsonl"], "rollout.sync_dir: good.jsonl is a file, not a folder"),
]
# these need transformers (and with it torch) to find the fault
HEAVY_CASES: list[tuple[list[str], str]] = [
    (["train", "tokenizer.yaml"], "model.path: cannot load a tokenizer from model: JSONDecodeError"),
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.parametrize(("argv", "needle"), LIGHT_CASES + HEAVY_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_cli_refuses_bad_input_with_one_line_and_exit_2(inputs: Path, argv: list[str], needle: str,
                                                       env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncflow", *argv], capture_output=True, text=True, timeout=120,
                          cwd=inputs, env=env or _env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("asyncflow: error: ") and needle in lines[0], lines[0]


def test_a_cache_folder_from_the_environment_that_is_a_file_is_refused_before_the_model_build(inputs: Path) -> None:
    """It was not checked (only model.cache_dir was): the run failed with a traceback after minutes of
    building the task's model."""
    test_cli_refuses_bad_input_with_one_line_and_exit_2(
        inputs, ["demo", "--set", "train.max_steps=1", "--set", "model.task_seed=1"],
        "ASYNCFLOW_CACHE: good.jsonl is a file, not a folder",
        env={**_env(), "ASYNCFLOW_CACHE": "good.jsonl"})


def test_bad_input_is_refused_before_torch_transformers_or_ray_load(inputs: Path) -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from asyncflow.cli import main\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(argv)\n"
        "    out.append([rc, err.getvalue()])\n"
        "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]\n"
        "print(json.dumps({'results': out, 'heavy': heavy}))\n"
    )
    argvs = [argv for argv, _ in LIGHT_CASES]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True, timeout=120,
                          cwd=inputs, env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for (argv, needle), (rc, err) in zip(LIGHT_CASES, report["results"], strict=True):
        assert rc == 2 and needle in err, (argv, err)
    assert report["heavy"] == []
    assert not (inputs / "runs").exists()  # nothing refused left a run folder behind


def test_tokenizer_without_pad_token_falls_back_to_eos_with_a_note(tmp_path: Path) -> None:
    from asyncflow.tasks.arith import make_tokenizer
    from asyncflow.tokenizer import load_tokenizer

    tok = make_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path))
    notes: list[str] = []
    loaded = load_tokenizer(tmp_path, log=notes.append)
    assert loaded.pad_token_id == loaded.eos_token_id is not None
    assert len(notes) == 1 and "no pad token; using EOS" in notes[0]


def test_tokenizer_without_eos_token_is_refused(tmp_path: Path) -> None:
    from asyncflow.tasks.arith import make_tokenizer
    from asyncflow.tokenizer import load_tokenizer

    tok = make_tokenizer()
    tok.eos_token = None
    tok.save_pretrained(str(tmp_path))
    with pytest.raises(UserError, match="has no EOS token"):
        load_tokenizer(tmp_path)


def test_token_ids_past_the_models_vocabulary_are_refused_before_the_run(tmp_path: Path) -> None:
    """A token added to the tokenizer but not to the model (a new <pad>, a tool tag) was looked up in
    the embedding mid-run: the decode thread died of an IndexError and every request failed."""
    from asyncflow.data import check_prompts_fit, model_vocab_size
    from asyncflow.tasks.arith import make_tokenizer
    from asyncflow.tokenizer import load_tokenizer

    tok = make_tokenizer()
    vocab = len(tok)
    tok.add_special_tokens({"pad_token": "<newpad>"})  # id `vocab`: one past the model's rows
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab}))
    assert model_vocab_size(tmp_path) == vocab
    with pytest.raises(UserError, match=rf"^model.path: the tokenizer's pad token '<newpad>' has id {vocab}, past the "
                                        rf"model's {vocab}-token vocabulary \(config.json vocab_size\)"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab + 1}))
    loaded = load_tokenizer(tmp_path)
    rows = [{"prompt": "1+2="}, {"prompt": "3+4=<newpad>"}]
    check_prompts_fit([(rows[:1], "d.jsonl")], "prompt", loaded, 4, None, vocab)
    with pytest.raises(UserError, match=rf"^d.jsonl, row 1: column 'prompt' \('3\+4=<newpad>'\) has token id {vocab}, "
                                        rf"past the model's {vocab}-token vocabulary"):
        check_prompts_fit([(rows, "d.jsonl")], "prompt", loaded, 4, None, vocab)
    check_prompts_fit([(rows, "d.jsonl")], "prompt", loaded, 4, None, vocab + 1)


def test_sharded_safetensors_index_names_a_missing_shard(tmp_path: Path) -> None:
    from asyncflow.model_folder import check_model_dir

    model = make_model_dir(tmp_path / "m", weights="none")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    write_safetensors(model / "model-00001-of-00002.safetensors")
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors is listed in model.safetensors.index.json but missing"):
        check_model_dir(model)
    write_safetensors(model / "model-00002-of-00002.safetensors")
    assert check_model_dir(model) == model


def test_weights_of_another_model_are_named_before_any_load(tiny_model, tmp_path: Path) -> None:
    """Well-formed safetensors that do not fit config.json: a shape off or a parameter missing is one
    line naming the tensor (not a traceback from `from_pretrained`, nor a silently random parameter)."""
    import torch
    from safetensors.torch import save_file

    from asyncflow.model_folder import check_weights_match_config

    good = tmp_path / "good"
    tiny_model.save_pretrained(good)
    check_weights_match_config(good)  # the model's own folder passes

    cfg = json.loads((good / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 48}))
    (other / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match=r"tensor 'model.embed_tokens.weight' has shape \[32, 64\], but config.json "
                                        r"implies \[48, 64\]"):
        check_weights_match_config(other)

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps(cfg))
    state = {k: v.contiguous() for k, v in tiny_model.state_dict().items() if k != "model.norm.weight"}
    save_file(state, str(partial / "model.safetensors"))
    with pytest.raises(UserError, match=r"has no tensor 'model.norm.weight'"):
        check_weights_match_config(partial)

    # a file of no tensors, or of none of the model's names: from_pretrained initialised every
    # parameter at random without a word, and the folder was served and trained as the model
    save_file({}, str(partial / "model.safetensors"))
    with pytest.raises(UserError, match=r"partial's weights \(model.safetensors\) hold no tensors$"):
        check_weights_match_config(partial)
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(32, 64)}, str(partial / "model.safetensors"))
    with pytest.raises(UserError, match=r"partial's weights share no tensor name with the 'qwen2' model its config.json "
                                        r"describes \(e.g. 'bert.embeddings.word_embeddings.weight', where it has "):
        check_weights_match_config(partial)
    # names saved without the base model's prefix are the model's own (transformers adds it on load)
    bare = {k.removeprefix("model."): v.contiguous() for k, v in tiny_model.state_dict().items()}
    save_file(bare, str(partial / "model.safetensors"))
    check_weights_match_config(partial)
    save_file({k: v for k, v in bare.items() if k != "norm.weight"}, str(partial / "model.safetensors"))
    with pytest.raises(UserError, match=r"has no tensor 'model.norm.weight'"):
        check_weights_match_config(partial)


def test_a_moe_checkpoint_whose_names_transformers_converts_on_load_is_accepted(tmp_path: Path) -> None:
    """transformers 5 stores Mixtral's experts one tensor each and fuses them on load: every such
    folder (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3) was refused as "the weights of another model"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncflow.model_folder import check_weights_match_config

    config = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, num_local_experts=2,
                                  num_experts_per_tok=1, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    check_weights_match_config(tmp_path / "moe")
    cfg = json.loads((tmp_path / "moe" / "config.json").read_text())  # a shape that differs is still named
    (tmp_path / "moe" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 80}))
    with pytest.raises(UserError, match=r"tensor 'model.embed_tokens.weight' has shape \[64, 32\]"):
        check_weights_match_config(tmp_path / "moe")


def test_bad_input_found_after_the_folder_is_written_leaves_no_half_made_run(arith_dir: Path, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh run that ends with bad input before it recorded anything (found only once running: an
    environment factory that returns no Env) removes the files it wrote, so the same command, fixed,
    is not refused as "already holds a run"."""
    from asyncflow.config import load_config
    from asyncflow.run_folder import check_out_dir
    from asyncflow.runner import train

    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "train.batch_size=8", "rollout.n=4", "eval.size=8",
                                "train.max_steps=1", "logging.progress=false"])

    async def bad_eval(self: Any, step: int) -> Any:
        raise UserError("rollout.env: 'x:make' returned NoneType, not an asyncflow.envs.Env")

    monkeypatch.setattr("asyncflow.evaluation.Evaluator.run", bad_eval)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="returned NoneType"):
        train(cfg, out, progress_enabled=False)
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="returned NoneType"):
        train(cfg, kept, progress_enabled=False)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]  # only what the run made is removed
    assert check_out_dir(kept, cfg) is None  # the retry is not refused


def test_a_run_that_fails_to_start_for_any_reason_leaves_no_half_made_run(arith_dir: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Only bad input removed the files a fresh run had made; a Ray cluster that could not start (a
    RuntimeError here) left config.yaml behind, and the same command, retried, was refused."""
    from asyncflow.config import load_config
    from asyncflow.run_folder import check_out_dir
    from asyncflow.runner import train

    def cannot_start(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("When connecting to an existing cluster, num_cpus must not be provided")

    monkeypatch.setattr("asyncflow.runtime.ray_runtime.RayWorkers.start", cannot_start)
    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "train.batch_size=8", "rollout.n=4", "eval.size=8",
                                "train.max_steps=1", "logging.progress=false", "runtime.kind=ray"])
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="existing cluster"):
        train(cfg, out, progress_enabled=False)
    assert not out.exists() and check_out_dir(out, cfg) is None


def test_prune_keeps_the_checkpoint_a_ray_run_resumed_from(tmp_path: Path) -> None:
    """Restarted Ray actors are built from the checkpoint the run resumed from; rotation deleted it
    and the restart then failed, ending the run."""
    from asyncflow.checkpoint import complete_checkpoints, prune_checkpoints

    for step in (2, 3, 4, 5):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "state.json").write_text("{}")
    prune_checkpoints(tmp_path, 2, protect=tmp_path / "checkpoints" / "step_2")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4, 5]
    prune_checkpoints(tmp_path, 2)  # (at the end of the run)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 5]


def test_two_runs_cannot_claim_one_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default run folder gets a suffix when a run started in the same second took its name, and
    a fresh run claims its folder by creating config.yaml exclusively (two runs at once into one
    folder interleaved their logs and one lost its final model)."""
    from asyncflow.cli import _default_out
    from asyncflow.config import Config
    from asyncflow.run_folder import RunFolder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt: "20261123-120000")
    first = _default_out("train")
    assert first == Path("runs/train-20261123-120000")
    first.mkdir(parents=True)
    assert _default_out("train") == Path("runs/train-20261123-120000-2")
    a, b = RunFolder(first, Config(), None), RunFolder(first, Config(), None)
    a.open()
    with pytest.raises(UserError, match="another asyncflow process is running in"):  # (its lock comes first)
        b.open()
    a.close()
    with pytest.raises(UserError, match="another run started in .* meanwhile"):  # (a finished run's config.yaml)
        b.open()


def test_a_timed_out_wait_ends_the_cli_with_one_line_and_exit_1(arith_dir: Path, tmp_path: Path) -> None:
    """A bounded wait that runs out is not bad input (exit 1), but still one line: what was awaited,
    the key that bounds it, and where the run can go on from."""
    (tmp_path / "run.yaml").write_text("task: arith\n")
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow", "train", "--out", str(tmp_path / "run"), str(tmp_path / "run.yaml"),
         "--set", f"model.path={arith_dir}", "--set", "train.batch_size=8", "--set", "rollout.n=4",
         "--set", "eval.size=8", "--set", "train.max_steps=2", "--set", "logging.progress=false",
         "--set", "workflow.step_timeout_s=0.001"],
        capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("asyncflow: error: timed out after 0.001 s waiting for"), last
    assert "(workflow.step_timeout_s" in last and "no checkpoint was written" in last


def test_chat_prompts_need_a_chat_template_named_with_file_and_line(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from asyncflow.data import check_chat_prompts, check_columns, read_rows

    chat = '{"prompt": [{"role": "user", "content": "1+1="}]}'
    (tmp_path / "d.jsonl").write_text(f'{{"prompt": "1+1="}}\n\n{chat}\n{chat}\n')
    rows = read_rows(tmp_path / "d.jsonl")
    first_chat = check_columns(rows, "d.jsonl", "prompt", None)
    assert first_chat == "d.jsonl, line 3"
    check_chat_prompts(first_chat, SimpleNamespace(chat_template="{{ x }}"))
    check_chat_prompts(check_columns(rows[:1], "d.jsonl", "prompt", None), SimpleNamespace(chat_template=None))
    with pytest.raises(UserError, match=r"^d.jsonl, line 3 is a chat conversation, but the tokenizer"):
        check_chat_prompts(first_chat, SimpleNamespace(chat_template=None))


@pytest.mark.parametrize(("body", "needle"), [
    ("[1]", "is not a JSON object"),
    ('{"format": 1}', "lacks step, version, logs, eval_history, counters, elapsed_s, next_group_id"),
    ('{"format": 1, "step": 2', "cannot read"),
])
def test_a_damaged_checkpoint_state_is_refused_with_one_line(tmp_path: Path, body: str, needle: str) -> None:
    from asyncflow.checkpoint import find_resume
    from asyncflow.config import Config

    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "state.json").write_text(body)
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    cfg = Config()
    cfg.train.max_steps = 5
    with pytest.raises(UserError, match=needle):
        find_resume(tmp_path, cfg)


def test_a_dataset_too_small_to_hold_out_evaluates_on_its_training_prompts(tmp_path: Path) -> None:
    """Under 10 rows and no eval.path there is nothing to hold out: the eval set used to be empty
    (and its rows reported a reward function error); now it is the training prompts, with a note."""
    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs

    make_model_dir(tmp_path / "model")
    (tmp_path / "small.jsonl").write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(5)))
    cfg, _ = load_config(None, ["task=null", f"model.path={tmp_path / 'model'}",
                                f"dataset.path={tmp_path / 'small.jsonl'}", "reward.fn=x:y"])
    notes: list[str] = []
    inputs = resolve_inputs(cfg, notes.append)
    assert len(inputs.train_rows) == 5 and inputs.eval_rows == inputs.train_rows
    assert len(notes) == 1 and "has 5 rows of 5 distinct prompt(s), too few to hold out an eval set" in notes[0]


def test_the_held_out_eval_slice_takes_every_copy_of_its_prompts(tmp_path: Path) -> None:
    """A dataset with repeated prompts (30 prompts twice) held out rows by index: 6 of the eval
    prompts were also trained on, which inflated eval accuracy. Now a prompt's copies stay together,
    and the rows keep their line numbers (messages name them)."""
    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs

    make_model_dir(tmp_path / "model")
    rows = "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(30))
    (tmp_path / "dups.jsonl").write_text(rows + rows)
    cfg, _ = load_config(None, ["task=null", f"model.path={tmp_path / 'model'}",
                                f"dataset.path={tmp_path / 'dups.jsonl'}", "reward.fn=x:y"])
    inputs = resolve_inputs(cfg, print)
    train = {r["prompt"] for r in inputs.train_rows}
    held = [r["prompt"] for r in inputs.eval_rows]
    assert len(held) == 6 and len(set(held)) == 3 and not train & set(held)
    assert len(inputs.train_rows) == 54 and len(train) == 27
    assert all(60 >= n > 0 for n in inputs.train_rows.lines) and len(inputs.eval_rows.lines) == 6  # type: ignore[attr-defined]


def test_the_held_out_slice_never_exceeds_its_share_and_every_row_is_trained_or_evaluated(tmp_path: Path) -> None:
    """Whole prompts were held out until the share was reached, so one prompt copied 95 times of 100
    took 95-98% of the data; and rows held out past eval.size were neither trained nor evaluated.
    The slice is at most 10% of the distinct prompts, their copies at most 20% of the rows: a prompt
    with more copies than that stays in training."""
    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs

    make_model_dir(tmp_path / "model")
    rows = ['{"prompt": "7+1=", "answer": "8"}\n'] * 95 + [f'{{"prompt": "{i}+2=", "answer": "{i + 2}"}}\n'
                                                           for i in range(15)]
    (tmp_path / "skew.jsonl").write_text("".join(rows))
    for seed in range(4):
        cfg, _ = load_config(None, ["task=null", f"model.path={tmp_path / 'model'}", f"seed={seed}",
                                    f"dataset.path={tmp_path / 'skew.jsonl'}", "reward.fn=x:y"])
        inputs = resolve_inputs(cfg, print)
        assert len(inputs.eval_rows) == 1 and inputs.eval_rows[0]["prompt"] != "7+1=", seed  # 1 of 16 prompts
        assert len(inputs.train_rows) + len(inputs.eval_rows) == 110, seed
    dups = "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(40)) * 8  # 40 prompts x 8
    (tmp_path / "dups.jsonl").write_text(dups)
    cfg, _ = load_config(None, ["task=null", f"model.path={tmp_path / 'model'}", "eval.size=10",
                                f"dataset.path={tmp_path / 'dups.jsonl'}", "reward.fn=x:y"])
    inputs = resolve_inputs(cfg, print)
    assert len(inputs.eval_rows) == 32 and len(inputs.train_rows) == 288  # 4 whole prompts (10%); none lost


def test_a_datasets_folder_gives_plain_rows_and_the_split_each_key_reads(tmp_path: Path) -> None:
    """eval.path read a DatasetDict's `train` split (evaluation on the training rows when both keys
    named one folder) and refused a folder of only `test`; a saved numpy format gave the reward
    function numpy labels."""
    import datasets

    from asyncflow.data import read_rows

    train = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(4)]
    test = [{"prompt": f"{i}+5=", "answer": i + 5} for i in range(2)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "both"))
    assert read_rows(tmp_path / "both") == train
    assert read_rows(tmp_path / "both", key="eval.path") == test
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(test)}).save_to_disk(str(tmp_path / "val"))
    assert read_rows(tmp_path / "val", key="eval.path") == test and read_rows(tmp_path / "val") == test
    datasets.DatasetDict({"a": datasets.Dataset.from_list(test), "b": datasets.Dataset.from_list(test)}).save_to_disk(
        str(tmp_path / "two"))
    with pytest.raises(UserError, match=r"holds splits \['a', 'b'\] but no 'test' or 'validation'"):
        read_rows(tmp_path / "two", key="eval.path")
    ds = datasets.Dataset.from_list(train)
    ds.set_format("numpy")
    ds.save_to_disk(str(tmp_path / "np"))
    got = read_rows(tmp_path / "np")
    assert got == train and type(got[0]["answer"]) is int and type(got[0]["prompt"]) is str


def test_no_dataset_path_and_no_train_jsonl_in_the_model_folder_names_what_to_set(tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs

    make_model_dir(tmp_path / "model")
    cfg, _ = load_config(None, ["task=arith", f"model.path={tmp_path / 'model'}"])
    with pytest.raises(UserError, match=r"dataset.path: not set, and model.path \(.*model\) has no train.jsonl"):
        resolve_inputs(cfg, print)
