"""Every config in examples/ loads, and each runs a few steps (model and sizes shrunk for the test)."""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncflow.cli import main
from asyncflow.config import load_config, read_yaml
from asyncflow.runner import train
from asyncflow.user_code import load_attr

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ALL = sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.yaml"))
# real models with vLLM on GPUs, fetched from the Hub: loaded here, never run (no GPU, no network); and
# the verifiers example on SmolLM2 (minutes on 2 cores; its taskset is played in tests/test_verifiers_env.py)
NOT_RUN_HERE = {"gsm8k/qwen_gsm8k.yaml", "verl_grpo.yaml", "verifiers/config.yaml"}
# run by the tests of their libraries' environments, as `asyncflow train` commands (the verifiers one
# on the calc model given a chat template): tests/test_openenv.py, tests/test_verifiers_env.py; and
# the real model's chat example, trained, checkpointed and resumed by tests/test_real_model.py
RUN_ELSEWHERE = {"openenv/config.yaml", "verifiers/calc.yaml", "smollm2_chat_arith.yaml"}
FAST = ["train.max_steps=2", "train.batch_size=16", "rollout.n=4", "eval.every=0", "eval.size=8",
        "logging.progress=false"]


def test_every_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:

    find_spec = importlib.util.find_spec  # vLLM counts as installed: only that check is skipped
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    assert {"arith_async.yaml", "arith_sync.yaml", "arith_offpolicy.yaml", "arith_dapo.yaml", "arith_ray.yaml",
            "calc_agent.yaml", "calc_turn_barrier.yaml", "byo/config.yaml", "agent/config.yaml", *NOT_RUN_HERE} <= set(ALL)
    for name in ALL:
        extra = ["model.path=/nonexistent"] if name.startswith("byo/") else []
        assert "task" in read_yaml(EXAMPLES / name), f"{name}: name its task (a pack, or null)"
        cfg, _ = load_config(EXAMPLES / name, extra)
        assert cfg.task in ("arith", "calc", "chat_arith", None), name


@pytest.mark.slow
# Ray: tests/test_ray.py; the examples for real models need GPUs and the Hub (they are loaded above)
@pytest.mark.parametrize("name", [n for n in ALL if n != "arith_ray.yaml" and n not in NOT_RUN_HERE | RUN_ELSEWHERE])
def test_example_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.chdir(EXAMPLES.parent)  # byo/config.yaml names its data and reward module from the repo root
    # the real model's examples on the real model (prepared once by scripts/test.sh), the others on the
    # quickly prepared task folders
    fixture = "smollm2_dir" if name.startswith("smollm2") else "calc_dir" if name.startswith("calc") else "arith_dir"
    model = request.getfixturevalue(fixture)
    extra = ["train.max_steps=3"] if name == "arith_offpolicy.yaml" else []
    if name.startswith("byo/"):
        extra = ["train.batch_size=16"]
    if name.startswith("smollm2"):  # (the task's prompts into this test's cache; one step of the real model)
        extra = ["rollout.max_new_tokens=24", f"model.cache_dir={tmp_path / 'cache'}", "train.max_steps=1"]
    cfg, _ = load_config(EXAMPLES / name, [*FAST, f"model.path={model}", *extra])
    out = tmp_path / "run"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == cfg.train.max_steps * cfg.train.batch_size
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, cfg.train.max_steps + 1))


def test_the_gsm8k_example_reads_hub_ids_and_its_reward_scores_the_last_number() -> None:
    from examples.gsm8k.reward import score

    cfg, _ = load_config(EXAMPLES / "gsm8k" / "qwen_gsm8k.yaml", ["rollout.engine=hf"])
    assert (cfg.model.path, cfg.dataset.path, cfg.dataset.config) == ("Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k", "main")
    assert (cfg.train.lr_schedule, cfg.train.gradient_checkpointing) == ("cosine", True)
    answers = ["Half of 48 is 24.\n#### 72", "#### 1,000", "#### 5"]
    assert score(["q"] * 3, ["So 48 + 24 = 72.", "It is 1000 in all", "no number"], answers) == [1.0, 1.0, 0.0]


def test_examples_at_deep_staleness_use_a_loss_the_algorithms_page_recommends_for_it() -> None:
    """docs/algorithms.md opens with a loss-per-staleness table; an example must not contradict it."""
    page = (EXAMPLES.parent / "docs" / "algorithms.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if line.startswith("| 8 to 16 | `"))
    recommended = set(row.split("|")[2].split("`")[1::2])
    assert recommended == {"ppo", "icepop"}, row
    deep = [name for name in ALL if name not in NOT_RUN_HERE and not name.startswith("byo/")
            and load_config(EXAMPLES / name)[0].staleness >= 8]
    assert "arith_offpolicy.yaml" in deep
    for name in deep:
        assert load_config(EXAMPLES / name)[0].algorithm.loss in recommended, name


def test_the_agent_example_resolves_from_the_repository_root(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(EXAMPLES.parent)  # the config names its agent by a path from the repository root
    assert main(["config", "examples/agent/config.yaml"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["task"] == "arith" and resolved["rollout"]["agent"] == "examples/agent/agent.py:solve"
    assert resolved["rollout"]["max_turns"] == 2 and "fn" not in resolved["reward"]
    solve = load_attr(resolved["rollout"]["agent"], "rollout.agent")  # as the run finds it
    assert asyncio.iscoroutinefunction(solve)


def _serve_completions(replies: list[str]) -> tuple[http.server.ThreadingHTTPServer, list[dict[str, Any]]]:
    """An OpenAI-style `/completions` endpoint on loopback answering `replies` in turn; it records
    every request body."""
    asked: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
            asked.append({**json.loads(self.rfile.read(int(self.headers["Content-Length"]))), "path": self.path})
            body = json.dumps({"choices": [{"text": replies[len(asked) - 1]}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, asked


@pytest.mark.parametrize(("replies", "reward"), [([" 55"], 1.0), (["54"], 0.0), (["=", "55"], 1.0), (["x", "y"], 0.0)])
def test_the_example_agent_answers_over_plain_http_and_retries_a_non_number_once(
        replies: list[str], reward: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(EXAMPLES.parent)
    solve = load_attr("examples/agent/agent.py:solve", "rollout.agent")
    server, asked = _serve_completions(replies)
    try:
        base_url = f"http://127.0.0.1:{server.server_address[1]}/episodes/k/v1"
        got = asyncio.run(asyncio.wait_for(solve(base_url, {"prompt": "47+8=", "answer": "55"}, 0), timeout=30))
    finally:
        server.shutdown()
        server.server_close()
    assert got == reward and len(asked) == len(replies)
    assert all(a["path"] == "/episodes/k/v1/completions" for a in asked) and asked[0]["prompt"] == "47+8="
    if len(asked) == 2:  # the retry continues the first call's text, so the two calls stitch into one sample
        assert asked[1]["prompt"].startswith("47+8=" + replies[0]) and asked[1]["prompt"].endswith("47+8=")
