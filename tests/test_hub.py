"""Hub ids in model.path / dataset.path / eval.path, resolved from a locally built Hugging Face cache
(the layout `snapshot_download` writes: `<kind>s--org--name/refs/main` + `snapshots/<commit>/...`)
with HF_HUB_OFFLINE=1; an id not in the cache fails in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncflow.hub import hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"
README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: other
  data_files:
  - split: train
    path: other/train-*
---
"""


def _cached(cache: Path, kind: str, repo: str) -> Path:
    """An empty snapshot folder of `repo` in the hub cache `cache`, as huggingface_hub lays it out."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    folder = root / "snapshots" / COMMIT
    folder.mkdir(parents=True)
    return folder


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache under tmp_path, offline (huggingface_hub reads both at import: patched too)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _gsm8k_like(cache: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = _cached(cache, "dataset", "org/math")
    (folder / "README.md").write_text(README)
    for config, split, n in (("main", "train", 12), ("main", "test", 3), ("other", "train", 2)):
        (folder / config).mkdir(exist_ok=True)
        rows = {"question": [f"{config} {split} {i}" for i in range(n)], "answer": [str(i) for i in range(n)]}
        pq.write_table(pa.table(rows), folder / config / f"{split}-00000-of-00001.parquet")


def test_what_counts_as_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hub_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct" and hub_id("openai/gsm8k")
    (tmp_path / "org" / "model").mkdir(parents=True)
    # an existing local path wins; paths and file names are never ids
    for value in ("org/model", "/abs/model", "./org/x", "data/train.jsonl", "models", "a/b/c", "~/x"):
        assert hub_id(value) is None, value


def test_a_cached_model_id_resolves_offline_and_loads(arith_dir: Path, offline_cache: Path) -> None:
    from transformers import AutoModelForCausalLM

    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs

    folder = _cached(offline_cache, "model", "org/tiny-arith")
    for f in arith_dir.iterdir():
        if f.is_file() and f.suffix != ".jsonl":
            shutil.copy(f, folder / f.name)
    _gsm8k_like(offline_cache)
    cfg, _ = load_config(None, ["task=null", "model.path=org/tiny-arith", "dataset.path=org/math",
                                "dataset.config=main", "eval.path=org/math", "reward.fn=examples.byo.reward:score",
                                "dataset.prompt_key=question", "dataset.label_key=answer"])
    inputs = resolve_inputs(cfg, print)
    assert inputs.model_dir == folder
    assert [r["question"] for r in inputs.train_rows] == [f"main train {i}" for i in range(12)]
    assert [r["question"] for r in inputs.eval_rows] == [f"main test {i}" for i in range(3)]  # eval.path: `test`
    AutoModelForCausalLM.from_pretrained(str(inputs.model_dir))


def test_an_uncached_id_offline_is_one_line_and_exit_2(offline_cache: Path, one_line_error, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("task: null\nmodel: {path: Qwen/Qwen2.5-0.5B-Instruct}\ndataset: {path: openai/gsm8k}\n"
                      "reward: {fn: 'examples.byo.reward:score'}\n")
    err = one_line_error(["train", str(config), "--out", str(tmp_path / "run")])
    assert "model.path: Qwen/Qwen2.5-0.5B-Instruct is not a local path" in err
    assert "not cached in" in err and "HF_HUB_OFFLINE is set (offline)" in err


def test_an_uncached_dataset_id_and_a_missing_config_are_one_line(offline_cache: Path) -> None:
    from asyncflow.data import read_rows
    from asyncflow.errors import UserError

    with pytest.raises(UserError, match=r"^dataset.path: openai/gsm8k is not a local path \(no /.*/openai/gsm8k\); as a Hugging Face Hub "
                                        r"dataset id it is not cached in .*HF_HUB_OFFLINE is set"):
        read_rows("openai/gsm8k")
    _gsm8k_like(offline_cache)
    with pytest.raises(UserError, match=r"^dataset.path: org/math \(Hub snapshot .*needs dataset.config") as info:
        read_rows("org/math")
    assert "\n" not in str(info.value)
    assert len(read_rows("org/math", config="other")) == 2


def test_without_network_an_uncached_id_says_the_hub_is_not_reachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    from huggingface_hub import constants, errors

    from asyncflow.errors import UserError
    from asyncflow.hub import snapshot

    def unreachable(*args, **kwargs):  # what snapshot_download raises when the lookup cannot connect
        raise errors.LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(UserError, match=r"^model.path: org/x is not a local path \(no /.*/org/x\); .*not cached in .*the Hub is not "
                                        r"reachable \(no network\?\)"):
        snapshot("org/x", "model.path")


def test_dataset_config_needs_a_hub_id(tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.errors import UserError

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n")
    with pytest.raises(UserError, match=r"^dataset.config: only used with a Hugging Face Hub dataset id"):
        load_config(None, ["task=arith", f"dataset.path={data}", "dataset.config=main"])


def test_a_model_snapshot_never_downloads_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """asyncflow never runs a repository's code, so a Python file in a model snapshot could only be
    imported by mistake (a `csv.py` beside the weights): none is fetched."""
    import fnmatch

    import huggingface_hub

    from asyncflow.hub import snapshot

    asked: dict[str, object] = {}

    def fake_download(repo_id: str, **kwargs: object) -> str:
        asked.update(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert snapshot("org/x", "model.path") == tmp_path
    patterns = asked["ignore_patterns"]
    assert isinstance(patterns, list)
    for name in ("csv.py", "modeling_x.py", "sub/tokenizer.py", "ext.so"):
        assert any(fnmatch.fnmatch(name, p) for p in patterns), name
    assert not any(fnmatch.fnmatch("model.safetensors", p) or fnmatch.fnmatch("tokenizer.json", p) for p in patterns)


@pytest.mark.parametrize(("value", "why"), [
    ("./missing/model", "it starts with './', a local path"),
    ("missing/dir/model", "it has 3 parts"),
    ("./a/b", "it starts with './', a local path"),
    ("../a/b", "it starts with '../', a local path"),
])
def test_a_missing_local_model_path_is_one_line_naming_it_never_a_download(
    value: str, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from asyncflow.config import load_config
    from asyncflow.errors import UserError
    from asyncflow.inputs import resolve_inputs

    downloads: list[str] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: downloads.append(repo_id))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cfg, _ = load_config(None, ["task=null", f"model.path={value}", "dataset.path=d.jsonl", "reward.fn=x:y"])
    looked_for = (tmp_path / "work" / value).resolve()
    with pytest.raises(UserError) as info:
        resolve_inputs(cfg, print)
    assert str(info.value) == (f"model.path: {value} does not exist (looked for {looked_for}); not taken as a Hugging "
                               f"Face Hub id: {why} (a Hub id is org/name, with no local folder of that name)")
    assert downloads == []


def test_a_missing_local_path_from_the_cli_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  one_line_error) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("task: null\nmodel: {path: ./org/model}\ndataset: {path: ./data/train}\n"
                                     "reward: {fn: 'examples.byo.reward:score'}\n")
    err = one_line_error(["train", "c.yaml", "--out", str(tmp_path / "run")])
    assert err.startswith(f"asyncflow: error: model.path: ./org/model does not exist (looked for "
                          f"{tmp_path.resolve() / 'org' / 'model'}); not taken as a Hugging Face Hub id")
    (tmp_path / "org" / "model").mkdir(parents=True)
    from asyncflow.data import read_rows
    from asyncflow.errors import UserError

    with pytest.raises(UserError, match=r"^dataset.path: \./data/train does not exist \(looked for .*/data/train\); "
                                        r"not taken as a Hugging Face Hub id: it starts with '\./'"):
        read_rows("./data/train")


def test_org_name_with_no_local_match_is_read_from_the_hub_and_the_run_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs

    snapshot_folder = tmp_path / "hub-snapshot"
    shutil.copytree(Path(__file__).resolve().parent.parent / "asyncflow/tasks/base_models/arith-v3-seed0",
                    snapshot_folder)
    downloads: list[str] = []

    def fake_download(repo_id: str, **kwargs: object) -> str:
        downloads.append(repo_id)
        return str(snapshot_folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cfg, _ = load_config(None, ["task=null", "model.path=a/b", f"dataset.path={snapshot_folder / 'train.jsonl'}",
                                "reward.fn=x:y"])
    notes: list[str] = []
    assert resolve_inputs(cfg, notes.append).model_dir == snapshot_folder
    assert downloads == ["a/b"]
    assert (f"[asyncflow] model.path: a/b is read from the Hugging Face Hub into {snapshot_folder} "
            f"(no local path {tmp_path.resolve() / 'work' / 'a' / 'b'})") in notes
