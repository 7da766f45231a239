"""Reading datasets (jsonl, parquet, saved datasets folders) and tokenizing prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncflow.data import Rows, check_columns, check_prompts_fit, model_positions, read_rows, tokenize_prompt
from asyncflow.errors import UserError


def test_jsonl_parquet_and_datasets_folder_give_the_same_rows(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": "1+1=", "a": "2"}, {"q": "2+2=", "a": "4"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    for name in ("d.jsonl", "d.parquet", "ds"):
        assert read_rows(tmp_path / name) == rows, name


def test_bad_datasets_name_the_file_and_row(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="empty.jsonl: the dataset is empty"):
        read_rows(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"prompt": \n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: malformed JSON \(Expecting value, column 12\)"):
        read_rows(tmp_path / "bad.jsonl")
    # a byte-order mark (Windows editors write one) and an upper-case suffix are still JSON lines
    (tmp_path / "bom.JSONL").write_bytes('{"prompt": "x"}\n{"prompt": "y"}\n'.encode("utf-8-sig"))
    assert read_rows(tmp_path / "bom.JSONL") == [{"prompt": "x"}, {"prompt": "y"}]
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="must be .jsonl, .parquet"):
        read_rows(tmp_path / "d.csv")
    # rows not read from JSON lines (parquet, a datasets folder) are named by index, from 0
    with pytest.raises(UserError, match=r"^f.parquet, row 1 has no column 'prompt' \(dataset.prompt_key\)"):
        check_columns([{"prompt": "a", "answer": "1"}, {"question": "b"}], "f.parquet", "prompt", "answer")
    with pytest.raises(UserError, match=r"^f.parquet, row 0 has no column 'answer'"):
        check_columns([{"prompt": "a"}], "f.parquet", "prompt", "answer")
    # JSON lines by the line an editor shows (blank lines counted)
    (tmp_path / "gap.jsonl").write_text('{"prompt": "a", "answer": "1"}\n\n\n{"prompt": "b"}\n')
    with pytest.raises(UserError, match=r"gap.jsonl, line 4 has no column 'answer'"):
        check_columns(read_rows(tmp_path / "gap.jsonl"), str(tmp_path / "gap.jsonl"), "prompt", "answer")
    # a null label (a parquet gap, a JSON null) is no label: every sample of the row was scored against None
    (tmp_path / "null.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": null}\n')
    with pytest.raises(UserError, match=r"null.jsonl, line 2: column 'answer' \(dataset.label_key\) is null"):
        check_columns(read_rows(tmp_path / "null.jsonl"), str(tmp_path / "null.jsonl"), "prompt", "answer")
    check_columns([{"prompt": "a", "answer": None}], "f.parquet", "prompt", None)  # (no label required)
    # a column named as a reward function's own argument: every call failed ("multiple values for
    # keyword argument"), or `completion_ids` was replaced unseen
    from asyncflow.data import REWARD_ARGUMENTS

    for name in ("completions", "prompts", "completion_ids"):
        with pytest.raises(UserError, match=rf"^f.parquet, row 1 has a column '{name}', a name the reward function"):
            check_columns([{"prompt": "a"}, {"prompt": "b", name: 1}], "f.parquet", "prompt", None, REWARD_ARGUMENTS)
    check_columns([{"prompts": "a"}], "f.parquet", "prompts", None, REWARD_ARGUMENTS)  # (the prompt column itself)
    check_columns([{"prompt": "a", "completions": 1}], "f.parquet", "prompt", None)  # (no reward function: env runs)


def test_text_prompts_are_tokenized_as_they_are_and_chats_use_the_template() -> None:
    from asyncflow.tasks.arith import make_tokenizer

    tok = make_tokenizer()
    assert tokenize_prompt(tok, "12+3=") == tok("12+3=")["input_ids"]
    assert len(tokenize_prompt(tok, "12+3=")) == 5  # nothing added: no BOS, no template
    with pytest.raises(UserError, match="chat template"):
        tokenize_prompt(tok, [{"role": "user", "content": "12+3="}])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    assert tokenize_prompt(tok, [{"role": "user", "content": "12+3"}]) == tok("12+3=")["input_ids"]


def test_prompts_that_do_not_fit_the_model_with_max_new_tokens_are_refused_in_one_line(tmp_path: Path) -> None:
    from asyncflow.tasks.arith import make_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 16}))
    assert model_positions(tmp_path) == 16
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32, "n_positions": 16}))
    assert model_positions(tmp_path) == 32
    assert model_positions(tmp_path / "nowhere") is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32768,
                                                      "rope_scaling": {"type": "yarn", "factor": 4.0}}))
    assert model_positions(tmp_path) is None  # (YaRN: 32,768 is not its limit)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32, "rope_scaling": None}))
    assert model_positions(tmp_path) == 32
    tok = make_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    rows = Rows({"q": p} for p in ["1+2=", "12+345=", [{"role": "user", "content": "1234+5678+9"}]])  # 4, 7, 12 tokens
    rows.lines = [1, 3, 4]
    sources: list[Any] = [(rows[:1], "eval.jsonl"), (rows, "train.jsonl")]
    check_prompts_fit(sources, "q", tok, 20, 32)  # 12 + 20 fits 32
    check_prompts_fit(sources, "q", tok, 10_000, None)  # the model does not say: no length to check
    with pytest.raises(UserError, match=r"^rollout\.max_new_tokens: 2 prompt\(s\) leave less room than 26 new tokens in "
                                        r"the model's 32 positions; the longest has 12 tokens \(train.jsonl, line 4: "
                                        r"'\[\{\"role\": \"user\", "):
        check_prompts_fit(sources, "q", tok, 26, 32)
    with pytest.raises(UserError, match=r"^rollout\.max_new_tokens: 32 leaves no room for a prompt in the model's 32 "):
        check_prompts_fit(sources, "q", tok, 32, 32)


def test_a_prompt_with_no_tokens_for_the_tokenizer_is_refused_naming_its_line() -> None:
    """The arith tokenizer knows no letters: "XYZ" became no tokens at all, passed every check, and
    the run died mid-way with a tensor-shape traceback."""
    from asyncflow.tasks.arith import make_tokenizer

    rows = Rows([{"prompt": "1+2="}, {"prompt": "XYZ"}])
    rows.lines = [1, 3]
    for positions in (None, 64):
        with pytest.raises(UserError, match=r"^data.jsonl, line 3: column 'prompt' \('XYZ'\) has no tokens with "
                                            r"model.path's tokenizer"):
            check_prompts_fit([(rows, "data.jsonl")], "prompt", make_tokenizer(), 8, positions)


def test_a_parquet_row_keeps_its_index_in_messages_after_the_hold_out(tmp_path: Path) -> None:
    """Messages about parquet or datasets rows named a row's position among the rows left after the
    eval hold-out (row 80 for row 90); JSON lines kept their line numbers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncflow.data import subset, where

    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(100)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    read = read_rows(tmp_path / "d.parquet")
    kept = subset(read, [i for i in range(100) if i % 10 != 3])  # 3, 13, ... held out
    assert kept[80]["prompt"] == "89+1=" and where(kept, "d.parquet", 80) == "d.parquet, row 89"
    again = subset(kept, [80])  # (the eval.size cut is a second subset)
    assert where(again, "d.parquet", 0) == "d.parquet, row 89"
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert where(subset(read_rows(tmp_path / "d.jsonl"), [89]), "d.jsonl", 0) == "d.jsonl, line 90"


def test_generation_config_stop_ids_end_a_response_as_the_eos_does(tmp_path: Path) -> None:
    """An instruct model's end-of-turn token is often only in generation_config.json (Llama-3's
    <|eot_id|> beside <|end_of_text|>): transformers' generate, vLLM and TRL stop on it, the hf engine
    did not (every response ran to max_new_tokens) and the completions kept it."""
    from asyncflow.config import load_config
    from asyncflow.data import generation_stop_ids
    from asyncflow.engines.factory import make_inference_engine
    from asyncflow.tasks.arith import make_model, make_tokenizer
    from asyncflow.tokenizer import Tokenizer

    hf = make_tokenizer()
    model = make_model(hf, seed=0, hidden=32, layers=1)
    model.generation_config.eos_token_id = [hf.eos_token_id, 7, 9999]  # (9999: past the vocabulary, left out)
    model.save_pretrained(tmp_path)
    hf.save_pretrained(tmp_path)
    assert generation_stop_ids(tmp_path, hf.eos_token_id) == (7,)
    assert generation_stop_ids(tmp_path / "none", hf.eos_token_id) == ()
    tok = Tokenizer(hf, hf.eos_token_id, hf.pad_token_id, generation_stop_ids(tmp_path, hf.eos_token_id))
    five = hf("5")["input_ids"]
    assert tok.completions([five + [7], five + [hf.eos_token_id], five], False) == ["5", "5", "5"]
    cfg, _ = load_config(None, ["task=arith", f"model.path={tmp_path}"])
    assert make_inference_engine(cfg, tmp_path, tok, 0).eos == {hf.eos_token_id, 7}
