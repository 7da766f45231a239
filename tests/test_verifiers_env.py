"""verifiers environments as asyncflow agents (`rollout.agent: verifiers:...`): the example tasksets,
written in verifiers' own API, played through the recording endpoint; the ids trained are the ids
generated, and the reward is the one verifiers' own scoring gives the same completion."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_doubles import ScriptedEngine

from asyncflow.clock import RealClock
from asyncflow.engines.base import GenRequest, GenResult
from asyncflow.errors import UserError
from asyncflow.workflow.agent import load_agent, run_agent_episode
from asyncflow.workflow.agent_proxy import AgentProxy, RecorderSettings

vf = pytest.importorskip("verifiers.v1")

ROOT = Path(__file__).resolve().parents[1]
ARITH = f"verifiers:{ROOT / 'examples/verifiers/arith_taskset.py'}"
CALC = f"verifiers:{ROOT / 'examples/verifiers/calc_tool_env.py'}"
SETTINGS = RecorderSettings(max_new_tokens=64, temperature=1.0, train_temperature=1.0, request_timeout_s=60.0,
                            max_calls=4)


def _smollm2_tok(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from asyncflow.tokenizer import Tokenizer

    return Tokenizer.of(AutoTokenizer.from_pretrained(smollm2_dir), smollm2_dir)


def _char_ids(tok: Any, text: str) -> list[int]:
    """`text` one token per character: ids no tokenizer would produce from the text (the trap)."""
    ids = [tok.hf.encode(c, add_special_tokens=False)[0] for c in text]
    assert tok.hf.decode(ids) == text and tok.hf.encode(text, add_special_tokens=False) != ids
    return ids


def _play(spec: str, row: dict[str, Any], tok: Any, turns: list[list[int]]) -> dict[str, Any]:
    agent = load_agent(spec)

    async def main() -> dict[str, Any]:
        proxy = AgentProxy()
        await proxy.start()
        try:
            return (await run_agent_episode(agent=agent, proxy=proxy, engine=ScriptedEngine(turns), clock=RealClock(), tok=tok,
                                            uid=3, row=row, seed=0, settings=SETTINGS, timeout_s=120.0)).fields
        finally:
            await proxy.close()

    return asyncio.run(main())


def _generated(fields: dict[str, Any]) -> list[list[int]]:
    """The response's generated runs (loss mask 1), in order."""
    ids, mask = list(fields["response_ids"]), [int(m) for m in fields["loss_mask"]]
    runs: list[list[int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(ids[i])
    return runs


async def _library_reward(spec: str, row: dict[str, Any], reply: str) -> float:
    """verifiers' own scoring (`Task.score`) of a trace whose reply is `reply`."""
    agent = load_agent(spec)
    task = agent.task(row)  # type: ignore[attr-defined]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                     agent=vf.AgentInfo(config=vf.AgentConfig()), root_reply=reply)
    await task.score(trace)
    return float(trace.reward)


def test_taskset_rows_carry_each_task_and_a_bad_id_is_one_line() -> None:
    from asyncflow.envs.verifiers_env import TASK_COLUMN, taskset_rows

    rows = taskset_rows(ARITH)
    assert len(rows) == 18 * 18 and rows[0]["prompt"] == "What is 2 * 2?"
    assert rows[0][TASK_COLUMN]["answer"] == "4" and json.loads(json.dumps(rows[5])) == rows[5]
    with pytest.raises(UserError, match="rollout.agent: 'verifiers:no_such_taskset_here'"):
        load_agent("verifiers:no_such_taskset_here")


def test_single_turn_rubric_trains_the_generated_ids_and_scores_as_verifiers_does(smollm2_dir: Path) -> None:
    from asyncflow.envs.verifiers_env import taskset_rows

    tok = _smollm2_tok(smollm2_dir)
    row = next(r for r in taskset_rows(ARITH) if r["prompt"] == "What is 7 * 8?")
    reply = "7 * 8 = 56"
    turn = [*_char_ids(tok, reply), tok.eos_token_id]
    fields = _play(ARITH, row, tok, [turn])
    assert fields["reward_error"] is None and fields["agent_calls"] == 1
    assert list(fields["response_ids"]) == turn  # the ids generated, not the text re-encoded
    assert fields["reward"] == pytest.approx(1.1)  # correct (weight 1) + brief (weight 0.1)
    assert fields["reward"] == pytest.approx(asyncio.run(_library_reward(ARITH, row, reply)))


def test_multi_turn_env_splices_exact_ids_across_its_feedback_turns(smollm2_dir: Path) -> None:
    from asyncflow.envs.verifiers_env import taskset_rows

    tok = _smollm2_tok(smollm2_dir)
    row = taskset_rows(CALC)[0]
    a, b = (int(x) for x in row["prompt"].rstrip("=").split("*"))
    turns = [[*_char_ids(tok, f"<calc>{a}*{b}</calc>"), tok.eos_token_id],
             [*_char_ids(tok, f"<answer>{a * b}</answer>"), tok.eos_token_id]]
    fields = _play(CALC, row, tok, turns)
    assert fields["reward_error"] is None and fields["agent_calls"] == 2 and fields["agent_calls_dropped"] == 0
    assert _generated(fields) == turns  # both turns exactly as generated, the env's feedback between them
    assert f"<result>{a * b}</result>" in tok.hf.decode(list(fields["response_ids"]))
    assert fields["reward"] == 1.0 == asyncio.run(_library_reward(CALC, row, f"<answer>{a * b}</answer>"))


TOOLSET = """
import verifiers.v1 as vf


class MulTools(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def multiply(self, a: int, b: int) -> str:
        \"\"\"Multiply two integers.\"\"\"
        return str(a * b)


if __name__ == "__main__":
    MulTools.run()
"""
TOOL_TASKSET = """
import re

import verifiers.v1 as vf
from af_mul_tools import MulTools


class MulData(vf.TaskData):
    answer: str


class MulTask(vf.Task[MulData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [MulTools(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: MulData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0


class MulTaskset(vf.Taskset[MulTask, vf.TasksetConfig]):
    def load(self):
        yield MulTask(MulData(prompt="What is 37 * 48? Use the tool.", answer="1776"))


__all__ = ["MulTaskset"]
"""
# a Hermes-style template: the tools in a system turn, calls as <tool_call>{...}</tool_call>
TOOL_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call one as <tool_call>{\"name\": "
                 "..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>"
                 "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                 "<|im_start|>assistant\n{% endif %}")


# verifiers' own MCP client calls tenacity with a keyword tenacity deprecates (not asyncflow's call)
@pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning")
def test_a_tool_env_calls_its_mcp_toolset_and_trains_the_exact_ids(smollm2_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A taskset whose task has an MCP `Toolset` (verifiers serves it as a local subprocess): the
    model's <tool_call> is run by the toolset, its result is the next turn's context."""
    (tmp_path / "af_mul_tools.py").write_text(TOOLSET)
    (tmp_path / "af_tool_taskset.py").write_text(TOOL_TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    from asyncflow.envs.verifiers_env import taskset_rows

    tok = _smollm2_tok(smollm2_dir)
    tok.hf.chat_template = TOOL_TEMPLATE
    spec = "verifiers:af_tool_taskset"
    prompts: list[str] = []

    def turns(call: int, prompt: str) -> str:
        prompts.append(prompt)
        if call == 0:  # (the tool's name as the harness offered it)
            name = re.search(r'"name": "(\w*multiply)"', prompt)
            assert name is not None, prompt
            call = {"name": name.group(1), "arguments": {"a": 37, "b": 48}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return "It is 1776"

    fields, generated = _play_live(spec, taskset_rows(spec)[0], tok, turns)
    assert fields["reward_error"] is None and fields["agent_calls"] == 2 and fields["agent_calls_dropped"] == 0
    assert _generated(fields) == generated and fields["reward"] == 1.0
    assert prompts[1].endswith("<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n")  # the toolset's answer


class _Live(ScriptedEngine):
    """Answers each call with `reply(call, prompt text)`, one token per character."""

    def __init__(self, tok: Any, reply: Any) -> None:
        super().__init__([])
        self.tok, self.reply = tok, reply

    async def generate(self, request: GenRequest) -> GenResult:
        text = self.reply(self.calls, self.tok.hf.decode(request.prompt_ids))
        self.turns.append([*_char_ids(self.tok, text), self.tok.eos_token_id])
        return await super().generate(request)


def _play_live(spec: str, row: dict[str, Any], tok: Any, reply: Any) -> tuple[dict[str, Any], list[list[int]]]:
    agent = load_agent(spec)
    engine = _Live(tok, reply)

    async def main() -> dict[str, Any]:
        proxy = AgentProxy()
        await proxy.start()
        try:
            return (await run_agent_episode(agent=agent, proxy=proxy, engine=engine, clock=RealClock(), tok=tok,
                                            uid=3, row=row, seed=0, settings=SETTINGS, timeout_s=120.0)).fields
        finally:
            await proxy.close()

    return asyncio.run(main()), engine.turns


def test_a_failed_verifiers_episode_is_its_sample_s_error(smollm2_dir: Path) -> None:
    tok = _smollm2_tok(smollm2_dir)
    fields = _play(ARITH, {"prompt": "What is 2 * 2?"}, tok, [[tok.eos_token_id]])
    assert fields["reward"] is None and "verifiers_task" in fields["reward_error"]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _calc_chat_model(folder: Path) -> Path:
    """The shipped calc model (its weights and tokenizer) given a chat template that joins the
    messages, each assistant turn closed by its EOS: the layout the model was warm-started on."""
    shutil.copytree(ROOT / "asyncflow/tasks/base_models/calc-v1-seed0", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|eos|>"
                               "{% endif %}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.slow
def test_asyncflow_train_runs_a_verifiers_env_and_logs_its_own_rewards(tmp_path: Path) -> None:
    """`asyncflow train` on the shipped calc model with the multi-turn env (examples/verifiers/calc.yaml)."""
    model = _calc_chat_model(tmp_path / "calc-chat")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncflow", "train", str(ROOT / "examples/verifiers/calc.yaml"), "--out", str(out),
           "--set", f"model.path={model}", "--set", f"model.cache_dir={tmp_path / 'cache'}", "--set", "train.max_steps=2", "--set", "train.batch_size=16",
           "--set", "rollout.n=4", "--set", "eval.size=8", "--set", "logging.progress=false"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["lost"] == 0 and summary["accounting"]["trained"] == 32
    samples = _rows(out / "samples.jsonl")
    assert {s["status"] for s in samples} == {"trained"}
    from asyncflow.envs.verifiers_env import taskset_rows

    rows = {r["prompt"]: r for r in taskset_rows(CALC)}
    for s in samples:
        last = s["response"].rsplit("</result>", 1)[-1]
        assert s["reward"] == asyncio.run(_library_reward(CALC, rows[s["prompt"]], last)), s
    assert any(s["turns"] == 2 for s in samples)


@pytest.mark.ray
@pytest.mark.slow
def test_verifiers_env_runs_in_the_rollout_actors_on_ray(ray_session, tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    model = _calc_chat_model(tmp_path / "calc-chat")
    cfg, _ = load_config(ROOT / "examples/verifiers/calc.yaml", [
        f"rollout.agent={CALC}", f"model.path={model}", f"model.cache_dir={tmp_path / 'cache'}", "runtime.kind=ray",
        "train.max_steps=2", "train.batch_size=16", "rollout.n=4", "eval.size=8", "logging.progress=false",
        "runtime.rollout_cpus=0.5", "runtime.train_cpus=0.5"])
    out = tmp_path / "run"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 32 and summary["reward_errors"] == 0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["accounting"]["lost"] == 0 and any(a["role"] == "rollout" for a in saved["actors"])
    assert any(s["turns"] == 2 for s in _rows(out / "samples.jsonl"))
