"""Tests for the built-in `calc` task pack: data, tokenizer, the SFT token layout, and a real
multi-turn training run against the calculator environment."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncflow.tasks import TASK_NAMES, calc, get_task


@pytest.fixture(scope="module")
def prepared(calc_dir: Path) -> Path:
    """A prepared folder with a short warm start (the real one is too slow for a test; conftest)."""
    return calc_dir


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------
# data and verifier


def test_splits_are_disjoint_deterministic_and_correct() -> None:
    train, evals = calc.make_splits(0)
    assert len(train) == calc.TRAIN_SIZE and len(evals) == sum(calc.EVAL_PER_LEVEL.values())
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in evals}) == len(evals)
    assert (train, evals) == calc.make_splits(0)
    assert evals != calc.make_splits(1)[1]
    assert {r["level"] for r in train} == {r["level"] for r in evals} == {1, 2}
    for r in train[:2000] + evals:
        a, b = r["prompt"].removesuffix("=").split("*")
        assert str(int(a) * int(b)) == r["answer"]
        # one prompt length and one answer length: the copy learned on one level serves both
        assert len(r["prompt"]) == 6 and len(r["answer"]) == 4


def test_reward_fn_takes_trl_signature_and_checks_the_answer_tag() -> None:
    completions = [
        "<calc>37*48</calc><result>1776</result><answer>1776</answer>",
        "<answer> 1776 </answer>",
        "<answer>1777</answer>",
        "1776",
        "<calc>37*48</calc>",
    ]
    assert calc.reward_fn(
        prompts=["37*48="] * 5, completions=completions, answer=["1776"] * 5, level=[2] * 5
    ) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # integers compare exactly: as floats, two beyond 2**53 that differ were equal (and paid)
    big = "365797893337905807"
    assert calc.reward_fn(prompts=["x"] * 3, completions=[f"<answer>{big}</answer>", "<answer>365797893337905808</answer>",
                                                          "<answer>1776.0</answer>"],
                          answer=[big, big, "1776"]) == [1.0, 0.0, 1.0]


def test_task_pack_is_registered_with_env_defaults() -> None:
    from asyncflow.config import load_config
    from asyncflow.errors import UserError

    assert "calc" in TASK_NAMES
    task = get_task("calc")
    assert task.name == "calc" and task.reward_fn_path == "asyncflow.tasks.calc:reward_fn"
    cfg, _ = load_config(None, ["task=calc"])
    assert cfg.rollout.env == "calculator" and cfg.reward.fn is None
    assert cfg.rollout.max_turns == calc.MAX_TURNS and cfg.eval.success_threshold == 1.0
    assert cfg.train.batch_size % cfg.rollout.n == 0
    # a turn budget that fits the longest correct turn plus its EOS
    assert cfg.rollout.max_new_tokens >= max(
        len(t) + 1 for t, gen in calc.transcript({"prompt": "37*48=", "answer": "1776"}) if gen
    )
    with pytest.raises(UserError, match="reward.fn"):
        load_config(None, ["task=calc", "reward.fn=asyncflow.tasks.calc:reward_fn"])


def test_importing_calc_does_not_import_torch() -> None:
    code = "import sys, asyncflow.tasks.calc; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_prepare_dispatches_to_the_calc_pack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from asyncflow import cli

    calls: list[tuple[Path, int]] = []

    def fake_prepare(out: Path, *, seed: int, log: Any) -> Path:
        calls.append((out, seed))
        return out

    monkeypatch.setattr(calc, "prepare", fake_prepare)
    assert cli.main(["prepare", "calc", "--out", str(tmp_path / "calc"), "--seed", "2"]) == 0
    assert calls == [(tmp_path / "calc", 2)]


# ---------------------------------------------------------------------------------------------------
# tokenizer and token layout


def _env_texts() -> list[str]:
    """Every text an episode can hold: a transcript, and each kind of calculator observation."""
    from asyncflow.clock import RealClock
    from asyncflow.envs import CalculatorEnv

    async def observations() -> list[str]:
        env = CalculatorEnv(RealClock())
        await env.reset({"answer": "1776"}, 0)
        steps = [
            await env.step(a)
            for a in (
                "hello",
                "<calc>37*48</calc>",
                "<calc>x+1</calc>",
                "<calc>1/0</calc>",
                "<calc>(1,2)</calc>",
            )
        ]
        return [s.observation for s in steps]

    return [
        "37*48=<calc>37*48</calc><result>1776</result><answer>1776</answer>",
        *asyncio.run(observations()),
    ]


def test_tokenizer_round_trips_every_char_and_survives_reload(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = calc.make_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    texts = [calc.CHARS, *_env_texts()]
    for text in texts:
        assert set(text) <= set(calc.CHARS), text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per char, none dropped
        assert tok.unk_token_id not in ids
        assert again(text, add_special_tokens=False)["input_ids"] == ids == again(text)["input_ids"]
        assert again.decode(ids + [again.eos_token_id], skip_special_tokens=True) == text
    assert (again.eos_token_id, again.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert "|" not in calc.CHARS  # the specials' names cannot be spelled by the model


def test_sft_labels_score_exactly_the_generated_tokens() -> None:
    tok = calc.make_tokenizer()
    row = {"prompt": "37*48=", "answer": "1776", "level": 2}
    ids, labels = calc.encode_transcript(tok, row)
    text = "37*48=<calc>37*48</calc>\0<result>1776</result><answer>1776</answer>\0"  # \0: EOS
    assert ids == [tok.eos_token_id if ch == "\0" else tok.convert_tokens_to_ids(ch) for ch in text]
    generated = [False] * 6 + [True] * 19 + [False] * 21 + [True] * 22
    assert labels == [i if g else -100 for i, g in zip(ids, generated, strict=True)]
    direct_ids, direct_labels = calc.encode_transcript(tok, row, use_tool=False)
    assert direct_labels == [-100] * 6 + direct_ids[6:] and direct_ids[-1] == tok.eos_token_id


class _ScriptedEngine:
    """Returns the given turns in order, checking each request's context against the expected ids."""

    version = 0

    def __init__(self, turns: list[list[int]], contexts: list[list[int]]) -> None:
        self.turns, self.contexts = turns, contexts

    async def generate(self, request: Any) -> Any:
        from asyncflow.engines.base import GenResult

        assert list(request.prompt_ids) == self.contexts.pop(0)
        ids = self.turns.pop(0)
        return GenResult(request.uid, ids, [0.0] * len(ids), [0] * len(ids), "stop")


@pytest.mark.parametrize("use_tool", [True, False])
def test_sft_layout_is_the_layout_run_episode_builds(tmp_path: Path, use_tool: bool) -> None:
    """The warm start's ids and labels equal prompt + response and loss mask of a real episode."""
    from transformers import AutoTokenizer

    from asyncflow.data import tokenize_prompt
    from asyncflow.envs import CalculatorEnv
    from asyncflow.tokenizer import Tokenizer
    from asyncflow.virtual_loop import run_virtual
    from asyncflow.workflow.episode import EpisodeSettings, run_episode

    calc.make_tokenizer().save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)  # as the runner loads it
    row = {"prompt": "347*6=", "answer": "2082", "level": 1}
    ids, labels = calc.encode_transcript(hf, row, use_tool=use_tool)
    prompt_ids = tokenize_prompt(hf, row["prompt"])
    # the generated turns, cut from the SFT ids at each labelled run, and the context before each
    turns: list[list[int]] = []
    contexts: list[list[int]] = []
    for i, lab in enumerate(labels):
        if lab != -100 and (i == 0 or labels[i - 1] == -100):
            turns.append([])
            contexts.append(ids[:i])
        if lab != -100:
            turns[-1].append(lab)
    engine = _ScriptedEngine(turns, contexts)
    tok = Tokenizer(hf, int(hf.eos_token_id), int(hf.pad_token_id))

    async def main(clock: Any) -> Any:
        return await run_episode(
            env=CalculatorEnv(clock, max_turns=calc.MAX_TURNS),
            engine=engine,
            clock=clock,
            tok=tok,
            uid=1,
            prompt_ids=prompt_ids,
            row=row,
            seed=0,
            settings=EpisodeSettings(calc.MAX_NEW_TOKENS, 1.0, 60.0, 60.0),
        )

    fields = run_virtual(main).fields
    assert fields["reward"] == 1.0 and fields["turns"] == (2 if use_tool else 1)
    assert prompt_ids + list(fields["response_ids"]) == ids
    assert [int(m) for m in fields["loss_mask"]] == [int(lab != -100) for lab in labels[len(prompt_ids) :]]
    assert engine.turns == [] and engine.contexts == []


# ---------------------------------------------------------------------------------------------------
# prepared folder and training


def test_prepared_folder_loads_and_holds_data(prepared: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared)
    model = AutoModelForCausalLM.from_pretrained(prepared)
    ids, _ = calc.encode_transcript(tok, {"prompt": "37*48=", "answer": "1776"})
    assert ids == calc.encode_transcript(calc.make_tokenizer(), {"prompt": "37*48=", "answer": "1776"})[0]
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert model.config.max_position_embeddings >= calc.MAX_TURNS * calc.MAX_NEW_TOKENS + 2 * 80
    with torch.no_grad():
        assert model(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), len(tok))
    train, evals = calc.make_splits(0)
    assert _rows(prepared / "train.jsonl") == train and _rows(prepared / "eval.jsonl") == evals
    meta = json.loads((prepared / "asyncflow_task.json").read_text())
    assert meta["task"] == "calc" and meta["version"] == calc.VERSION and meta["sft_steps"] == 30
    assert 0.0 <= meta["base_eval_success"] <= 1.0 and 0.0 <= meta["base_tool_use"] <= 1.0
    assert not [p for p in prepared.parent.iterdir() if p.name.startswith(".")]
    assert calc.cached_prepare(prepared.parent, seed=0, sft_steps=30) == prepared  # reused, not rebuilt


def test_play_episodes_follow_the_episode_layout(prepared: Path) -> None:
    """The pack's own episode player (used for the base model's success) ends every turn the way
    run_episode does and scores with the environment."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared)
    model = AutoModelForCausalLM.from_pretrained(prepared).eval()
    rows = [{"prompt": "37*48=", "answer": "1776"}, {"prompt": "347*6=", "answer": "2082"}]
    for temperature in (0.0, 1.0):
        for ep, row in zip(calc.play_episodes(model, tok, rows, temperature=temperature), rows, strict=True):
            assert ep["ids"][:6] == tok(row["prompt"])["input_ids"]
            assert 1 <= ep["turns"] <= calc.MAX_TURNS and ep["reward"] in (0.0, 1.0)
            assert len(ep["ids"]) - 6 >= ep["turns"]

    async def inside_a_run() -> list[dict[str, Any]]:  # the runner calls prepare from its event loop
        return calc.play_episodes(model, tok, rows)

    assert asyncio.run(inside_a_run()) == calc.play_episodes(model, tok, rows)


@pytest.mark.slow
def test_multi_turn_training_run_with_the_calculator(prepared: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from asyncflow.config import load_config
    from asyncflow.runner import train

    out = tmp_path / "run"
    cfg, _ = load_config(
        None,
        [
            "task=calc",
            f"model.path={prepared}",
            "train.max_steps=3",
            "train.batch_size=16",
            "rollout.n=4",
            "eval.size=32",
            "eval.every=2",
            "logging.progress=false",
        ],
    )
    assert cfg.rollout.env == "calculator"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 3 * 16 and summary["reward_errors"] == 0
    tok = AutoTokenizer.from_pretrained(prepared)
    trained = [s for s in _rows(out / "samples.jsonl") if s["status"] == "trained"]
    assert len(trained) == 48
    for s in trained:
        assert 1 <= s["turns"] <= calc.MAX_TURNS and s["reward"] in (0.0, 1.0)
        # the response decodes without EOS (at most one per turn); env text adds tokens, never removes
        assert s["turns"] <= s["generated_tokens"] <= len(tok(s["response"])["input_ids"]) + s["turns"]
    metrics = _rows(out / "metrics.jsonl")
    last = [r for r in metrics if r["kind"] == "train"][-1]
    assert last["step"] == 3 and last["tokens"] == sum(s["generated_tokens"] for s in trained)
    evals = [r for r in metrics if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3] and all(r["eval_size"] == 32 for r in evals)
    trace = json.loads((out / "trace.json").read_text())
    env_tids = {
        e["tid"] for e in trace if e.get("name") == "thread_name" and e["args"]["name"].startswith("env/")
    }
    spans = [e["name"] for e in trace if e.get("ph") == "X" and e["tid"] in env_tids]
    assert spans and all(n.startswith("episode ") and " step " in n for n in spans)
    assert len(spans) >= sum(
        s["turns"] for s in trained
    )  # one env step per turn (eval episodes are not traced)
