"""Black-box agents (`rollout.agent`): the recording OpenAI endpoint, stitching, failures, a real run."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from engine_doubles import ScriptedEngine

from asyncflow.clock import RealClock
from asyncflow.config import load_config
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine
from asyncflow.engines.http_client import HTTPError, request_json
from asyncflow.errors import UserError
from asyncflow.telemetry.audit import audit
from asyncflow.workflow.agent import run_agent_episode
from asyncflow.workflow.agent_proxy import AgentProxy, EpisodeRecorder, RecorderSettings

SETTINGS = RecorderSettings(max_new_tokens=4, temperature=1.0, train_temperature=1.0, request_timeout_s=30.0,
                            max_calls=4)


def _scripted(turns: list[list[int]]) -> ScriptedEngine:
    """Token k of a turn: log-prob -0.25 (k + 1), its version the call's number; the engine at version 2."""
    return ScriptedEngine(turns, logprob=lambda k: -0.25 * (k + 1), version=2, versions_by_call=True)

def _tiny(tiny_model: Any) -> tuple[Any, InferenceEngine]:
    """A char-level tokenizer over `tiny_model`'s 32-token vocabulary (eos=1, pad=0) and an HFEngine."""
    from asyncflow.engines.hf import HFEngine
    from asyncflow.tasks.tiny import char_tokenizer
    from asyncflow.tokenizer import Tokenizer

    hf = char_tokenizer("0123456789+= ?qa", ("<pad>", "<eos>", "<bos>", "<unk>"), 128)
    tok = Tokenizer(hf, int(hf.eos_token_id), int(hf.pad_token_id))
    return tok, HFEngine(tiny_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch=4, seed=0)


def _episode(engine: InferenceEngine, tok: Any, agent: Callable[[str, dict[str, Any], int], Awaitable[Any]],
             timeout_s: float = 30.0, floor: Callable[[], float] | None = None,
             settings: RecorderSettings = SETTINGS) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        proxy = AgentProxy()
        await proxy.start()
        try:
            result = await run_agent_episode(agent=agent, proxy=proxy, engine=engine, clock=RealClock(), tok=tok,
                                             uid=7, row={"prompt": "1+2=", "answer": "3"}, seed=0, settings=settings,
                                             timeout_s=timeout_s, floor=floor)
        finally:
            await proxy.close()
            await engine.close()
        return result.fields

    return asyncio.run(main())


async def _post(base_url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = await request_json("POST", f"{base_url}{route}", body, timeout=30)
    return reply["choices"][0]


def test_completion_calls_become_one_sample_with_the_engines_exact_ids_and_logprobs(tiny_model: Any) -> None:
    import torch

    tok, engine = _tiny(tiny_model)
    replies: list[dict[str, Any]] = []
    added = tok.encode(" ?")

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> dict[str, Any]:
        c1 = await _post(base_url, "/completions", {"prompt": row["prompt"], "max_tokens": 3})
        # text continuing the previous prompt + reply: spliced onto the exact ids, not re-tokenized
        c2 = await _post(base_url, "/completions", {"prompt": row["prompt"] + c1["text"] + " ?", "max_tokens": 3})
        # a token-id prompt continuing the previous call
        c3 = await _post(base_url, "/completions", {"prompt": c2["prompt_token_ids"] + c2["token_ids"] + added})
        replies.extend([c1, c2, c3])
        return {"reward": float(c1["text"].strip() == row["answer"]), "note": "extra keys are fine"}

    f = _episode(engine, tok, agent)
    assert f["reward_error"] is None and f["turns"] == 3 and f["agent_calls_dropped"] == 0
    prompt = tok.prompt_ids("1+2=")
    assert list(f["prompt_ids"]) == prompt == replies[0]["prompt_token_ids"]
    r1, r2, r3 = (c["token_ids"] for c in replies)
    assert replies[1]["prompt_token_ids"] == prompt + r1 + added
    assert list(f["response_ids"]) == r1 + added + r2 + added + r3
    assert list(f["loss_mask"]) == [1] * len(r1) + [0] * len(added) + [1] * len(r2) + [0] * len(added) + [1] * len(r3)
    lps = [c["logprobs"]["token_logprobs"] for c in replies]
    assert list(f["behavior_logprobs"]) == lps[0] + [0.0] * len(added) + lps[1] + [0.0] * len(added) + lps[2]
    assert list(f["token_versions"]) == [0] * len(f["response_ids"]) and f["behavior_version"] == 0
    # the behavior log-probs are the model's own (teacher-forced) log-probs of the generated tokens
    model = tiny_model
    ids = torch.tensor([prompt + list(f["response_ids"])])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    mine = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1:]
    mask = torch.tensor(f["loss_mask"], dtype=torch.bool)
    assert torch.allclose(mine[mask], torch.tensor(f["behavior_logprobs"])[mask], atol=1e-4)


def test_chat_calls_splice_generated_ids_and_render_only_the_new_turn(tiny_model: Any) -> None:
    tok, engine = _tiny(tiny_model)
    tok.hf.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}q {{ m['content'] }} "
                            "{% else %}a {{ m['content'] }}{{ eos_token }} {% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}a {% endif %}")
    replies: list[dict[str, Any]] = []

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        # OpenAI content parts are read as their text, as `asyncflow serve` does (their repr was the prompt)
        msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "1+2"},
                                                                   {"type": "text", "text": "="}]}]
        c1 = await _post(base_url, "/chat/completions", {"messages": msgs, "max_tokens": 3})
        msgs += [c1["message"], {"role": "user", "content": [{"type": "text", "text": "2+2="}]}]
        # a null max_tokens beside max_completion_tokens (clients that send unset fields as null)
        c2 = await _post(base_url, "/chat/completions", {"messages": msgs, "max_tokens": None,
                                                         "max_completion_tokens": 1})
        replies.extend([c1, c2])
        return 0.5

    f = _episode(engine, tok, agent)
    r1, r2 = replies[0]["token_ids"], replies[1]["token_ids"]
    eos, space = tok.eos_token_id, tok.encode(" ")
    p1 = tok.encode("q 1+2= a ")
    closing = space if r1[-1] == eos else [eos, *space]  # the template's end of turn, minus an EOS generated
    added = closing + tok.encode("q 2+2= a ")
    assert replies[0]["prompt_token_ids"] == p1 and replies[1]["prompt_token_ids"] == p1 + r1 + added
    assert len(r2) == 1
    assert f["reward"] == 0.5 and f["turns"] == 2 and list(f["prompt_ids"]) == p1
    assert list(f["response_ids"]) == r1 + added + r2
    assert list(f["loss_mask"]) == [1] * len(r1) + [0] * len(added) + [1] * len(r2)


def test_a_turn_ended_on_a_stop_id_the_template_closes_with_is_spliced_once() -> None:
    """A model whose end of turn is a generation stop id, not the tokenizer's EOS (Gemma's
    <end_of_turn>, Phi-3's <|end|>): the turn generated it and the template closes an assistant turn
    with it. The splice kept both, so every later turn was prompted (and trained) on <eot><eot>, a
    context the template never produces."""
    from asyncflow.tasks.tiny import char_tokenizer
    from asyncflow.tokenizer import Tokenizer

    hf = char_tokenizer("0123456789+= ?qa\n", ("<pad>", "<eos>", "<bos>", "<unk>"), 128)
    hf.add_special_tokens({"additional_special_tokens": ["<eot>"]})
    eot = int(hf.convert_tokens_to_ids("<eot>"))
    tok = Tokenizer(hf, int(hf.eos_token_id), int(hf.pad_token_id), stop_ids=(eot,))
    hf.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}q {{ m['content'] }}\n"
                        "{% else %}a {{ m['content'] }}<eot>\n{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}a {% endif %}")
    engine = _scripted([[*tok.encode("3"), eot], [*tok.encode("4"), eot]])

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "1+2="}]
        c1 = await _post(base_url, "/chat/completions", {"messages": msgs})
        msgs += [c1["message"], {"role": "user", "content": "2+2="}]
        await _post(base_url, "/chat/completions", {"messages": msgs})
        return 1.0

    f = _episode(engine, tok, agent)
    history = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
               {"role": "user", "content": "2+2="}]
    fresh = hf.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert hf.decode(engine.prompts[1]) == fresh == "q 1+2=\na 3<eot>\nq 2+2=\na "
    assert f["turns"] == 2 and f["agent_calls_dropped"] == 0
    assert list(f["loss_mask"]) == [1, 1] + [0] * len(tok.encode("\nq 2+2=\na ")) + [1, 1]


def test_a_rewritten_history_keeps_the_longest_consistent_prefix_of_calls() -> None:
    tok = _FakeTok()
    engine = _scripted([[10, 11], [12, 1], [13]])

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        c1 = await _post(base_url, "/completions", {"prompt": [5, 6]})
        c2 = await _post(base_url, "/completions", {"prompt": [5, 6, *c1["token_ids"], 20]})
        await _post(base_url, "/completions", {"prompt": [5, 6, 21, *c2["token_ids"]]})  # history edited
        return 1.0

    f = _episode(engine, tok, agent)
    assert f["agent_calls"] == 3 and f["turns"] == 2 and f["agent_calls_dropped"] == 1 and f["reward"] == 1.0
    assert list(f["prompt_ids"]) == [5, 6] and list(f["response_ids"]) == [10, 11, 20, 12, 1]
    assert list(f["loss_mask"]) == [1, 1, 0, 1, 1]
    assert list(f["behavior_logprobs"]) == [-0.25, -0.5, 0.0, -0.25, -0.5]
    assert list(f["token_versions"]) == [1, 1, 1, 2, 2] and f["behavior_version"] == 1
    assert f["finish_reason"] == "stop"


def test_an_agent_episode_under_the_staleness_floor_is_refused_its_next_call_and_cancelled() -> None:
    """The trainer's floor passes the episode's first call (version 1) after it: its next call gets
    409 and the episode ends `cancelled` (its group is dropped), instead of playing on to be dropped
    as stale anyway."""
    floor = {"v": 0.0}
    seen: list[str] = []

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        c1 = await _post(base_url, "/completions", {"prompt": [5, 6]})
        floor["v"] = 2.0  # weights published meanwhile: version 1 is now too old
        try:
            await _post(base_url, "/completions", {"prompt": [5, 6, *c1["token_ids"], 20]})
        except HTTPError as exc:
            seen.append(str(exc))
            raise
        return 1.0

    f = _episode(_scripted([[10, 11], [12]]), _FakeTok(), agent, floor=lambda: floor["v"])
    assert f["finish_reason"] == "cancelled" and f["agent_calls"] == 1
    assert seen and "HTTP 409" in seen[0] and "older than workflow.max_staleness allows" in seen[0]
    floor["v"] = 1.0  # at the floor, not under it: the episode plays on
    f = _episode(_scripted([[10, 11], [12]]), _FakeTok(), agent, floor=lambda: floor["v"] - 1.0)
    assert f["finish_reason"] == "stop" and f["agent_calls"] == 2 and f["reward"] == 1.0


def test_the_staleness_floor_reads_the_first_call_that_generated_tokens() -> None:
    """A first call that generated nothing has no version: the check reads the next one (version 2
    here), which it used to skip, so such an episode was never cut."""
    floor = {"v": 0.0}

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        await _post(base_url, "/completions", {"prompt": [5, 6]})  # generates nothing
        await _post(base_url, "/completions", {"prompt": [5, 6, 7]})  # tokens of version 2
        floor["v"] = 3.0
        await _post(base_url, "/completions", {"prompt": [5, 6, 7, 10, 11]})
        return 1.0

    f = _episode(_scripted([[], [10, 11], [12]]), _FakeTok(), agent, floor=lambda: floor["v"])
    assert f["finish_reason"] == "cancelled" and f["agent_calls"] == 2


def test_hung_failing_or_silent_agents_end_their_episode_with_reward_error() -> None:
    async def hangs(base_url: str, row: dict[str, Any], seed: int) -> float:
        await _post(base_url, "/completions", {"prompt": [5]})
        await asyncio.sleep(30)
        return 1.0

    f = _episode(_scripted([[9]]), _FakeTok(), hangs, timeout_s=0.3)
    assert f["reward"] is None and "agent hung" in f["reward_error"] and "agent_timeout_s=0.3" in f["reward_error"]
    assert list(f["response_ids"]) == [9]  # what it generated is still recorded (and logged, untrained)

    async def raises(base_url: str, row: dict[str, Any], seed: int) -> float:
        raise RuntimeError("tool crashed")

    f = _episode(_scripted([]), _FakeTok(), raises)
    assert f["reward"] is None and "RuntimeError: tool crashed" in f["reward_error"]

    async def silent(base_url: str, row: dict[str, Any], seed: int) -> float:
        return 1.0

    f = _episode(_scripted([]), _FakeTok(), silent)
    assert f["reward_error"] == "agent made no model call" and list(f["response_ids"]) == []

    async def bad_reward(base_url: str, row: dict[str, Any], seed: int) -> Any:
        await _post(base_url, "/completions", {"prompt": [5]})
        return "yes"

    f = _episode(_scripted([[9]]), _FakeTok(), bad_reward)
    assert f["reward"] is None and "expected a finite number" in f["reward_error"]


def test_the_endpoint_refuses_what_it_cannot_record_faithfully() -> None:
    seen: list[str] = []

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        for body in ({"prompt": [5], "temperature": 0.7}, {"prompt": [5], "n": 2}, {"prompt": [5], "stop": [""]},
                     {"prompt": [999]}):
            with pytest.raises(HTTPError) as err:
                await _post(base_url, "/completions", body)
            seen.append(str(err.value))
        for _ in range(SETTINGS.max_calls):
            await _post(base_url, "/completions", {"prompt": [5], "temperature": 1.0, "max_tokens": 99})
        with pytest.raises(HTTPError) as err:
            await _post(base_url, "/completions", {"prompt": [5]})
        seen.append(str(err.value))
        # a refusal tells the OpenAI SDK not to retry it (it retried 409 and 429 twice, with back-off)
        host, port = base_url.split("//")[1].split("/")[0].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"prompt": [5]}).encode()
        path = base_url.split(port, 1)[1] + "/completions"
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = (await reader.read()).split(b"\r\n\r\n")[0].decode()
        writer.close()
        assert head.startswith("HTTP/1.1 429") and "x-should-retry: false" in head.lower()
        models = await request_json("GET", f"{base_url}/models", timeout=10)
        assert models["data"][0]["id"] == "asyncflow-policy"
        return 0.0

    engine = _scripted([[9]] * SETTINGS.max_calls)
    f = _episode(engine, _FakeTok(), agent)
    assert f["reward_error"] is None, f["reward_error"]
    assert "rollout.temperature=1" in seen[0] and "n:" in seen[1] and "stop" in seen[2] and "vocabulary" in seen[3]
    assert "max_turns=4" in seen[4] and "429" in seen[4]


def test_an_agent_call_gets_at_most_the_positions_its_prompt_leaves() -> None:
    """An agent's call was sent whatever its length: past the model's positions a learned-position
    model failed the engine (ending the run). Now `max_tokens` is cut to the room left, and a prompt
    that fills the positions is a 400 the agent can act on, not counted as a turn."""
    import dataclasses

    asked: list[int] = []

    class _Asked(ScriptedEngine):
        async def generate(self, request: GenRequest) -> GenResult:
            asked.append(request.max_new_tokens)
            return await super().generate(request)

    seen: list[str] = []

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        await _post(base_url, "/completions", {"prompt": [5, 5, 5], "max_tokens": 4})
        for n in (6, 7):
            with pytest.raises(HTTPError) as err:
                await _post(base_url, "/completions", {"prompt": [5] * n})
            seen.append(str(err.value))
        return 1.0

    f = _episode(_Asked([[9, 9, 9]]), _FakeTok(), agent, settings=dataclasses.replace(SETTINGS, max_context=6))
    assert asked == [3] and f["reward"] == 1.0 and f["turns"] == 1
    assert all("HTTP 400" in e and "fill the model's 6 positions" in e for e in seen), seen


def test_rollout_agent_is_refused_with_env_or_reward_fn(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="rollout.agent: not used with rollout.env"):
        load_config(None, ["task=arith", "rollout.agent=m:f", "rollout.env=calculator"])
    with pytest.raises(UserError, match="reward.fn: not used with rollout.agent"):
        load_config(None, ["task=arith", "rollout.agent=m:f", "reward.fn=m:g"])
    with pytest.raises(UserError, match="must be 'module:function'"):
        load_config(None, ["task=arith", "rollout.agent=nocolon"])
    cfg, _ = load_config(None, ["task=arith", "rollout.agent=m:f"])
    assert cfg.rollout.agent == "m:f"
    assert load_config(None, ["task=arith", "rollout.agent=m:f", "runtime.kind=ray"])[0].runtime.kind == "ray"
    # a base config's reward.fn set back to null on the command line is not "set": an agent or env is taken
    base = tmp_path / "base.yaml"
    base.write_text("task: arith\nreward: {fn: m:g}\n")
    assert load_config(base, ["reward.fn=null", "rollout.agent=m:f"])[0].rollout.agent == "m:f"
    assert load_config(base, ["reward.fn=null", "rollout.env=calculator"])[0].rollout.env == "calculator"
    with pytest.raises(UserError, match="reward.fn: not used with rollout.env"):
        load_config(base, ["rollout.env=calculator"])


AGENT_MODULE = '''
import asyncio, json, urllib.request

def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]

async def solve(base_url, row, seed):
    """Two plain-HTTP calls: answer, then continue the text with a check question."""
    c1 = await asyncio.to_thread(_post, base_url + "/completions", {"prompt": row["prompt"], "max_tokens": 6})
    await asyncio.to_thread(_post, base_url + "/completions", {"prompt": row["prompt"] + c1["text"] + " ?",
                                                               "max_tokens": 2})
    return float(c1["text"].strip() == str(row["answer"]))
'''


@pytest.mark.slow
def test_a_short_train_run_trains_black_box_agent_episodes(arith_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow.runner import train

    (tmp_path / "http_agent.py").write_text(AGENT_MODULE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "rollout.agent=http_agent.py:solve", "train.max_steps=3",
                                "train.batch_size=16", "rollout.n=4", "eval.size=8", "eval.every=0",
                                "logging.progress=false"])
    summary = train(cfg, out, progress_enabled=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    assert [r["policy_version"] for r in steps] == [1, 2, 3] and summary["samples"] == 48
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 48
    assert all(s["agent_calls"] == 2 and s["turns"] == 2 and s["agent_calls_dropped"] == 0 for s in trained)
    assert all(0 < s["generated_tokens"] <= 8 for s in trained)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and evals[-1]["eval_size"] == 8 and evals[-1]["eval_error"] is None


class _FakeHF:
    chat_template = None

    def __len__(self) -> int:
        return 100


class _FakeTok:
    """Enough of the workflow's `Tokenizer` for id-only calls."""

    eos_token_id = 1
    hf = _FakeHF()

    def decode(self, ids: Any) -> str:
        return " ".join(map(str, ids))

    def encode(self, text: str) -> list[int]:
        return []


def test_an_agent_may_return_a_numpy_number_as_its_reward() -> None:
    """`reward.fn` accepts NumPy scalars; the agent's reward refused them as a reward_error."""
    import numpy as np

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> Any:
        await _post(base_url, "/completions", {"prompt": [5]})
        return {"reward": np.float32(0.5)}

    f = _episode(_scripted([[9]]), _FakeTok(), agent)
    assert f["reward"] == 0.5 and f["reward_error"] is None


class _CountingHF(_FakeHF):
    """A tokenizer whose tokens stand for 2 characters at most, counting the calls that convert a prompt."""

    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __init__(self) -> None:
        self.converted = 0

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bb": 1}

    def __call__(self, text: str, **kwargs: Any) -> dict[str, list[int]]:
        self.converted += 1
        return {"input_ids": [5] * len(text)}

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool, **kwargs: Any) -> Any:
        text = "".join(m["content"] for m in messages)
        if tokenize:
            self.converted += 1
            return [5] * len(text)
        return text


def test_a_call_past_its_limits_is_refused_before_its_prompt_is_converted() -> None:
    """A call's prompt was tokenized (its chat rendered) before n, the run's sampling or the model's
    positions were checked: any text the body limit allowed was converted first."""
    import dataclasses

    hf = _CountingHF()
    tok = _FakeTok()
    tok.hf = hf  # type: ignore[assignment]
    seen: list[str] = []

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        for route, body in (("/completions", {"prompt": "a" * 11}), ("/completions", {"prompt": "a", "n": 2}),
                            ("/completions", {"prompt": "a", "temperature": 0.5}),
                            ("/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 6}),
                            ("/chat/completions", {"messages": [{"role": "user", "content": "a" * 11}]})):
            with pytest.raises(HTTPError) as err:
                await _post(base_url, route, body)
            seen.append(str(err.value))
        assert hf.converted == 0
        await _post(base_url, "/completions", {"prompt": "aaa"})
        return 1.0

    f = _episode(_scripted([[9]]), tok, agent, settings=dataclasses.replace(SETTINGS, max_context=6))
    assert f["reward"] == 1.0 and f["turns"] == 1 and hf.converted == 1, f
    assert all("HTTP 400" in e for e in seen), seen
    assert "11 characters fill the model's 6 positions (a token here is at most 2 characters)" in seen[0]
    assert "n:" in seen[1] and "rollout.temperature" in seen[2]
    assert "6 messages cannot fit the 5 tokens" in seen[3]
    assert "the conversation (11 characters) cannot fit the 5 tokens" in seen[4]


async def _raw(port: int, request: bytes, timeout: float = 10) -> tuple[int, dict[str, str], Any]:
    """(status, lower-case headers, JSON body) of one request written as it is to the agent endpoint."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(payload) if payload else None


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"not within 10 s: {what}")


def _proxy_test(body: Callable[[AgentProxy, str], Awaitable[None]], **limits: Any) -> None:
    """Run `body(proxy, key)` with an agent endpoint (`limits`) and one registered episode, `key`."""
    async def main() -> None:
        proxy = AgentProxy(**limits)
        await proxy.start()
        try:
            url = proxy.register(EpisodeRecorder(_scripted([[9]]), _FakeTok(), 3, SETTINGS, RealClock()))
            await body(proxy, url.split("/")[-2])
        finally:
            await proxy.close()

    asyncio.run(main())


def test_a_request_for_an_unknown_episode_is_answered_404_from_its_headers_before_its_body() -> None:
    """The endpoint read a body of up to 64 MiB, as slowly as the client sent it, before it looked
    the episode key up (the request below never sends its body: it waited 60 s for it)."""
    async def body(proxy: AgentProxy, key: str) -> None:
        announce = "POST {} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n"
        status, headers, reply = await _raw(proxy.port, announce.format("/episodes/0-gone/v1/completions",
                                                                        64 << 20).encode())
        assert status == 404 and "'0-gone' is not running" in reply["error"]["message"]
        assert headers["x-should-retry"] == "false"
        assert (await _raw(proxy.port, announce.format("/elsewhere", 64 << 20).encode()))[0] == 404
        status, _, reply = await _raw(proxy.port, announce.format(f"/episodes/{key}/v1/completions",
                                                                  (64 << 20) + 1).encode())
        assert status == 413 and f"larger than the {64 << 20} bytes allowed" in reply["error"]["message"]
        data = json.dumps({"prompt": [5]}).encode()  # (a small body is read: its client sees the 404, not a reset)
        for path, expected in (("/episodes/0-gone/v1/completions", 404), (f"/episodes/{key}/v1/completions", 200)):
            status, _, reply = await _raw(proxy.port, announce.format(path, len(data)).encode() + data)
            assert status == expected, reply
        assert reply["choices"][0]["token_ids"] == [9]

    _proxy_test(body)


def test_the_agent_endpoint_bounds_request_headers_in_count_and_size() -> None:
    """It kept every header line of a request, however many."""
    async def body(proxy: AgentProxy, key: str) -> None:
        get = f"GET /episodes/{key}/v1/models HTTP/1.1\r\nHost: x\r\n"
        for extra, message in (("".join(f"X-{i}: 1\r\n" for i in range(100)), "more than 100 header lines"),
                               ("".join(f"X-{i}: {'a' * 2000}\r\n" for i in range(40)),
                                "more than 65536 bytes of header lines"),
                               (f"X-Big: {'a' * 70_000}\r\n", "a line longer than the 65536 bytes allowed")):
            status, _, reply = await _raw(proxy.port, (get + extra + "\r\n").encode())
            assert status == 431 and reply["error"]["message"] == f"request headers: {message}", reply
        extra = "".join(f"X-{i}: {'a' * 1000}\r\n" for i in range(40))  # 40 KiB in 41 lines: within the bounds
        status, _, reply = await _raw(proxy.port, (get + extra + "\r\n").encode())
        assert status == 200 and reply["data"][0]["id"] == "asyncflow-policy"

    _proxy_test(body)


def test_connections_past_the_cap_wait_their_turn_and_past_the_queue_get_503(
        capsys: pytest.CaptureFixture[str]) -> None:
    """There was no cap: every connection was taken and read at once."""
    async def body(proxy: AgentProxy, key: str) -> None:
        models = f"GET /episodes/{key}/v1/models HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        idle = [await asyncio.open_connection("127.0.0.1", proxy.port) for _ in range(2)]
        await _until(lambda: proxy.gate.active == 2, "two connections answered at once")
        queued = asyncio.ensure_future(_raw(proxy.port, models, timeout=30))
        await _until(lambda: proxy.gate.waiting == 1, "a third connection queued")
        status, headers, reply = await _raw(proxy.port, models)
        assert status == 503 and headers["retry-after"] == "1" and "x-should-retry" not in headers
        assert "2 connections open and 1 waiting" in reply["error"]["message"] and not queued.done()
        idle[0][1].close()  # a turn frees up: the queued request is answered
        status, _, reply = await queued
        assert status == 200 and reply["data"][0]["id"] == "asyncflow-policy"
        assert (proxy.gate.waited, proxy.gate.refused) == (1, 1)
        idle[1][1].close()

    _proxy_test(body, max_connections=2, max_waiting=1, wait_s=30.0)
    err = capsys.readouterr().err
    assert "agent proxy: 2 connections are open; later ones wait" in err and "agent proxy: refused a connection" in err

    async def waits_too_long(proxy: AgentProxy, key: str) -> None:
        _, idle = await asyncio.open_connection("127.0.0.1", proxy.port)
        await _until(lambda: proxy.gate.active == 1, "one connection answered")
        status, _, reply = await _raw(proxy.port, f"GET /episodes/{key}/v1/models HTTP/1.1\r\n\r\n".encode())
        assert status == 503 and "waited 0.2 s for one of the agent endpoint's 1 connections" in reply["error"]["message"]
        idle.close()

    _proxy_test(waits_too_long, max_connections=1, max_waiting=4, wait_s=0.2)


# ---- an `async def` agent that blocks (a synchronous HTTP call to its endpoint, a `time.sleep`) cannot
# freeze the run: it runs on a loop and thread of its own (`workflow/agent_thread.py`)
def _bounded(fn: Any, limit_s: float) -> Any:
    """`fn()` in a thread, failing the test (not hanging it) if it has not returned in `limit_s`:
    on a single loop, a blocking agent deadlocked the episode for good."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # (re-raised in the test's thread)
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"the episode did not end within {limit_s} s (the rollout loop is blocked)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _sync_post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.loads(r.read())["choices"][0]  # type: ignore[no-any-return]


def test_an_async_agent_calling_its_endpoint_synchronously_completes_its_episode() -> None:
    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        first = _sync_post(base_url + "/completions", {"prompt": [5]})  # blocks this agent's loop
        _sync_post(base_url + "/completions", {"prompt": [5, *first["token_ids"], 7]})
        return 1.0

    start = time.monotonic()
    f = _bounded(lambda: _episode(_scripted([[9], [10]]), _FakeTok(), agent, timeout_s=30.0), 25.0)
    assert f["reward_error"] is None and f["reward"] == 1.0
    assert f["agent_calls"] == 2 and f["agent_calls_dropped"] == 0 and list(f["response_ids"]) == [9, 7, 10]
    assert time.monotonic() - start < 10


def test_an_agent_blocking_past_its_timeout_ends_its_episode_with_an_error_naming_the_line() -> None:
    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        _sync_post(base_url + "/completions", {"prompt": [5]})
        time.sleep(3.0)  # blocks its own loop past rollout.agent_timeout_s
        return 1.0

    start = time.monotonic()
    f = _bounded(lambda: _episode(_scripted([[9]]), _FakeTok(), agent, timeout_s=0.5), 25.0)
    assert time.monotonic() - start < 2.5  # ended at its timeout, not when the sleep returned
    assert f["reward"] is None and f["reward_error"].startswith(
        "agent hung: episode 7 took longer than rollout.agent_timeout_s=0.5 s; its event loop is blocked in a "
        "synchronous call at ")
    assert "test_agent_proxy.py:" in f["reward_error"] and "in agent" in f["reward_error"]
    assert list(f["response_ids"]) == [9]  # what it generated is recorded (logged, untrained)


BLOCKING_AGENT = '''
import json, time, urllib.request

def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]

async def solve(base_url, row, seed):
    """Synchronous HTTP from an async agent; one episode in five blocks past its timeout."""
    c1 = _post(base_url + "/completions", {"prompt": row["prompt"], "max_tokens": 6})
    if seed % 5 == 0:
        time.sleep(3.0)
    return float(c1["text"].strip() == str(row["answer"]))
'''


@pytest.mark.slow
def test_a_run_with_blocking_agents_goes_on_and_accounts_every_sample(arith_dir: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow.runner import train

    (tmp_path / "blocking_agent.py").write_text(BLOCKING_AGENT)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "rollout.agent=blocking_agent.py:solve", "train.max_steps=2",
                                "train.batch_size=16", "rollout.n=4", "rollout.agent_timeout_s=1.0", "eval.size=4",
                                "eval.every=0", "logging.progress=false"])
    summary = _bounded(lambda: train(cfg, out, progress_enabled=False), 240.0)
    assert summary["steps"] == 2 and summary["accounting"]["lost"] == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    hung = [s for s in samples if (s["error"] or "").startswith("agent hung")]
    assert hung and all(s["status"] == "reward_error" and "blocked in a synchronous call at" in s["error"]
                        and "blocking_agent.py" in s["error"] for s in hung)
    acc = summary["accounting"]
    # (a batch counts its reward_error samples, kept out of the loss: 2 steps of 16 samples)
    assert acc["reward_error"] == len(hung) and acc["trained"] + acc["reward_error"] == 32 and acc["trained"] > 0
    assert audit(acc, Counter(s["status"] for s in samples)) == []  # every sample logged once


HERMES_LIKE = ("{% if tools %}tools:{% for t in tools %}{{ t['function']['name'] }} {% endfor %}<tool_call>{% endif %}"
               "{% for m in messages %}{% if m['role'] == 'user' %}q {{ m['content'] }} {% elif m['role'] == 'tool' %}"
               "t {{ m['content'] }} {% else %}a {{ m['content'] }}{{ eos_token }} {% endif %}{% endfor %}"
               "{% if add_generation_prompt %}a {% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def test_tool_call_parsers_per_template_family() -> None:
    from asyncflow.tool_calls import parse_hermes, parse_llama3, tool_parser

    content, calls = parse_hermes('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "Let me add." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert parse_hermes("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    content, calls = parse_llama3('<|python_tag|>{"name": "add", "parameters": {"a": "1;2"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": "1;2"}
    assert len(parse_llama3('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}')[1]) == 2
    assert parse_llama3("The answer is {x}") == ("The answer is {x}", [])
    assert tool_parser(HERMES_LIKE) is parse_hermes
    assert tool_parser("<|start_header_id|>... {\"name\": ..., \"parameters\": ...}") is parse_llama3
    assert tool_parser("{{ messages }}") is None


def test_an_sdk_agent_with_tools_stop_and_streams_is_recorded_exactly(tiny_model: Any) -> None:
    """The official SDK (async) against the proxy: `tools` reach the chat template, a `stop` string
    cuts the turn (its recorded ids end at the token completing it), streamed turns record the same."""
    openai = pytest.importorskip("openai")
    tok, engine = _tiny(tiny_model)
    tok.hf.chat_template = HERMES_LIKE
    seen: dict[str, Any] = {}

    async def agent(base_url: str, row: dict[str, Any], seed: int) -> float:
        c = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30)
        try:
            msgs: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
            r1 = await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS, max_tokens=4, stop=["="],
                                                 seed=3)  # type: ignore[arg-type]
            msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "3"}]
            stream = await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS, max_tokens=4,
                                                     stream=True, logprobs=True, top_logprobs=2)  # type: ignore[arg-type]
            chunks = [ch async for ch in stream]
            seen.update(r1=r1, chunks=chunks)
        finally:
            await c.close()
        return 1.0

    settings = RecorderSettings(max_new_tokens=4, temperature=1.0, train_temperature=1.0, request_timeout_s=30.0,
                                max_calls=4)
    f = _episode(engine, tok, agent, settings=settings)
    assert f["reward_error"] is None and f["turns"] == 2 and f["agent_calls_dropped"] == 0, f
    r1 = seen["r1"].choices[0]
    r1_ids = r1.model_extra["token_ids"]
    user = [{"role": "user", "content": "1+2="}]
    p1, plain = (list(tok.hf.apply_chat_template(user, tools=tools, add_generation_prompt=True)["input_ids"])
                 for tools in (TOOLS, None))
    assert r1.model_extra["prompt_token_ids"] == p1 and list(f["prompt_ids"]) == p1 and p1 != plain  # tools rendered
    text = tok.decode(r1_ids)
    assert "=" not in (r1.message.content or "") and (r1.finish_reason == "stop") == ("=" in text)
    if "=" in text:  # the turn ends at the token completing the stop string
        assert text.index("=") == len(text) - 1
    streamed = [t for ch in seen["chunks"] if ch.choices for t in (ch.choices[0].model_extra or {}).get("token_ids", [])]
    assert 1 <= len(streamed) <= 4 and list(f["response_ids"])[-len(streamed):] == streamed
    assert list(f["response_ids"])[: len(r1_ids)] == r1_ids and f["loss_mask"][0] == 1


TOOLS_AGENT_MODULE = '''
import openai

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]

async def solve(base_url, row, seed):
    """A tool-using chat agent on the official SDK: `tools` and a `stop` string in both calls."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    try:
        msgs = [{"role": "user", "content": row["prompt"]}]
        r1 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, stop=["="],
                                                  max_tokens=6, seed=seed)
        msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "1"}]
        r2 = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, stop=["="],
                                                  max_tokens=4)
    finally:
        await client.close()
    return float(row["answer"] in (r1.choices[0].message.content or "") + (r2.choices[0].message.content or ""))
'''


@pytest.mark.slow
def test_a_tool_using_agent_with_stop_strings_trains_through_the_proxy(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The calc base model with a tool-rendering chat template: an SDK agent sending `tools` and
    `stop` trains for 3 steps, both calls of every episode recorded, every sample accounted for."""
    import shutil

    pytest.importorskip("openai")
    from asyncflow.runner import train

    model = tmp_path / "calc-chat"
    shutil.copytree(Path(__file__).resolve().parent.parent / "asyncflow/tasks/base_models/calc-v1-seed0", model)
    cfg_path = model / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**tok_cfg, "chat_template": HERMES_LIKE}))
    (tmp_path / "tools_agent.py").write_text(TOOLS_AGENT_MODULE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    cfg, _ = load_config(None, ["task=null", f"model.path={model}", f"dataset.path={model / 'train.jsonl'}",
                                "dataset.label_key=answer", "rollout.agent=tools_agent.py:solve", "train.max_steps=3",
                                "train.batch_size=16", "rollout.n=4", "eval.size=8", "eval.every=0",
                                "logging.progress=false"])
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 48 and summary["accounting"]["lost"] == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 48 and all(s["agent_calls"] == 2 and s["agent_calls_dropped"] == 0 for s in trained)
