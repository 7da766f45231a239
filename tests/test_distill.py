"""On-policy distillation: the per-token advantages, the teacher's log-probs (a model folder and a
server's echoed prompt log-probs), the teacher folder's checks, and the stage in a real run."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.algorithms.advantages import distill_advantages
from asyncflow.algorithms.losses import LossSettings, policy_loss
from asyncflow.engines.base import Norm
from asyncflow.engines.teacher import ServerTeacher, check_teacher_folder
from asyncflow.engines.torch_train import ReferenceModel
from asyncflow.errors import RunFailed, UserError
from asyncflow.workflow.batch import build_train_batch


def test_distill_advantages_by_hand() -> None:
    adv = torch.tensor([0.5, -1.0])
    behavior = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.25, 0.0]])
    teacher = torch.tensor([[0.0, -1.5, -0.5], [-1.5, -0.25, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = distill_advantages(adv, behavior, teacher, mask, coef=0.5, reward_coef=2.0)
    # token (0,1): 2 x 0.5 - 0.5 x (-1 - -1.5) = 1 - 0.25; (0,2): 1 - 0.5 x (-2 - -0.5) = 1 + 0.75
    # token (1,0): 2 x -1 - 0.5 x (-0.5 - -1.5) = -2.5; (1,1): -2 - 0 = -2; masked tokens: 0
    assert out.tolist() == [[0.0, 0.75, 1.75], [-2.5, -2.0, 0.0]]
    pure = distill_advantages(adv, behavior, teacher, mask, coef=1.0, reward_coef=0.0)
    assert pure.tolist() == [[0.0, -0.5, 1.5], [-1.0, 0.0, 0.0]]  # -(log mu - log teacher) alone


def test_the_loss_takes_per_token_advantages() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    mask = torch.ones(2, 2)
    norm = Norm(tokens=4.0, seqs=2.0)
    s = LossSettings(loss="reinforce")
    per_row, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -2.0]), mask, norm, s)
    expanded, _ = policy_loss(logp, logp.detach(), torch.tensor([[1.0, 1.0], [-2.0, -2.0]]), mask, norm, s)
    assert float(per_row.detach()) == pytest.approx(float(expanded.detach()))
    per_token, _ = policy_loss(logp, logp.detach(), torch.tensor([[3.0, 0.0], [0.0, -1.0]]), mask, norm, s)
    (grad,) = torch.autograd.grad(per_token, logp)
    assert grad.tolist() == [[-0.75, 0.0], [0.0, 0.25]]  # -A / tokens, token by token


def _save_tiny(folder: Path, *, vocab: int = 32, zero_head: bool = False, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, eos_token_id=1, pad_token_id=0,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    if zero_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    model.save_pretrained(str(folder))
    (folder / "vocab.json").write_text(json.dumps({f"t{i}": i for i in range(vocab)}))
    return folder


def test_a_teacher_folder_scores_each_response_token(tmp_path: Path) -> None:
    prompts, responses = [[5, 6, 7], [9]], [[3, 4], [2, 8, 1]]
    batch = build_train_batch(prompts, responses, [[0.0] * 2, [0.0] * 3], torch.zeros(2), [True, True], 0)
    # a teacher whose output head is zero gives every token of a 32-token vocabulary log(1/32)
    flat = ReferenceModel(_save_tiny(tmp_path / "flat", zero_head=True), temperature=1.0)(batch)
    assert (flat * batch.response_mask).tolist() == (batch.response_mask * -math.log(32)).tolist()
    # any teacher: position t holds log softmax(logits_t / T)[token t+1], T the rollout temperature
    from transformers import AutoModelForCausalLM

    folder = _save_tiny(tmp_path / "random", seed=3)
    lp = ReferenceModel(folder, temperature=0.7)(batch)
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(ids).logits[0] / 0.7
        for k, tok in enumerate(r):
            t = len(p) - 1 + k  # the logits at position t predict token t+1
            assert float(lp[i, t]) == pytest.approx(float(torch.log_softmax(logits[t], -1)[tok]), abs=1e-5)


def test_a_teacher_folder_must_share_the_policy_vocabulary(tmp_path: Path) -> None:
    policy = _save_tiny(tmp_path / "policy")
    assert check_teacher_folder(_save_tiny(tmp_path / "same", seed=1), policy) == tmp_path / "same"
    with pytest.raises(UserError, match=r"^algorithm.distill.teacher: .*a vocabulary of 48 tokens, the policy"):
        check_teacher_folder(_save_tiny(tmp_path / "wide", vocab=48), policy)
    other = _save_tiny(tmp_path / "other", seed=1)
    (other / "vocab.json").write_text(json.dumps({f"u{i}": i for i in range(32)}))
    with pytest.raises(UserError, match=r"vocab.json maps tokens to other ids than the policy's"):
        check_teacher_folder(other, policy)
    with pytest.raises(UserError, match=r"^algorithm.distill.teacher: .*missing does not exist"):
        check_teacher_folder(tmp_path / "missing", policy)


class _EchoServer(BaseHTTPRequestHandler):
    """A stand-in for a server's /v1/completions with echo (vLLM's reply shape): every prompt token
    after the first gets log-prob -0.1 x its id; the first None, as servers send it."""

    requests: list[dict[str, Any]] = []
    retokenize = False

    def do_GET(self) -> None:  # noqa: N802
        self._reply({"object": "list", "data": [{"id": "teacher-model", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({**body, "auth": self.headers.get("Authorization")})
        choices = []
        for i, ids in enumerate(body["prompt"]):
            echoed = [*ids[:-1], 99] if type(self).retokenize else ids
            choices.append({"index": i, "text": "", "logprobs": {
                "token_ids": echoed + [4], "token_logprobs": [None] + [-0.1 * t for t in ids[1:]] + [-1.0]}})
        self._reply({"choices": choices})

    def _reply(self, data: Any) -> None:
        raw = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_teacher_reads_echoed_prompt_logprobs() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        batch = build_train_batch([[5, 6], [7]], [[3], [2, 8]], [[0.0], [0.0, 0.0]], torch.zeros(2), [True, True], 0)
        teacher = ServerTeacher(url, timeout_s=10, token="sekrit")
        lp = asyncio.run(teacher(batch))
        assert torch.allclose(lp, torch.tensor([[-0.6, -0.3], [-0.2, -0.8]]))
        sent = _EchoServer.requests[-1]
        assert sent["prompt"] == [[5, 6, 3], [7, 2, 8]] and sent["model"] == "teacher-model"
        assert sent["echo"] is True and sent["logprobs"] == 0 and sent["auth"] == "Bearer sekrit"
        _EchoServer.retokenize = True
        with pytest.raises(RunFailed, match=r"choice 0: echoed other token ids than sent"):
            asyncio.run(teacher(batch))
    finally:
        _EchoServer.retokenize = False
        server.shutdown()


def test_asyncflow_serve_echoes_prompt_logprobs_and_is_a_server_teacher(make_server: Any, serve_dir: Path) -> None:
    server = make_server(max_batch=8)
    prompts, responses = [[5, 6, 7], [9, 4]], [[3, 4], [2, 8, 1]]
    batch = build_train_batch(prompts, responses, [[0.0] * 2, [0.0] * 3], torch.zeros(2), [True, True], 0)
    # the teacher through HTTP gives what the same model's trainer-side pass gives (temperature 1)
    served = asyncio.run(ServerTeacher(f"{server.url}/v1", timeout_s=60)(batch))
    local = ReferenceModel(serve_dir, temperature=1.0)(batch)
    assert torch.allclose(served * batch.response_mask, local * batch.response_mask, atol=1e-4)
    # the reply itself: the prompt's ids and log-probs (the first None) before the choice's own
    body = json.dumps({"prompt": [[5, 6, 7]], "max_tokens": 2, "echo": True, "logprobs": 0}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/completions", data=body), timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    lp = choice["logprobs"]
    assert choice["prompt_token_ids"] == [5, 6, 7] and lp["token_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == 3 + len(choice["token_ids"]) == len(lp["tokens"])
    one = build_train_batch([[5]], [[6, 7]], [[0.0, 0.0]], torch.zeros(1), [True], 0)
    assert lp["token_logprobs"][1:3] == pytest.approx(ReferenceModel(serve_dir, temperature=1.0)(one)[0, :2].tolist(),
                                                      abs=1e-4)


def test_distill_config_is_checked() -> None:
    from asyncflow.config import load_config

    cases = [
        ([], "algorithm.distill.teacher: required"),
        (["algorithm.distill.teacher=http://127.0.0.1:1/v1", "rollout.temperature=0.7"],
         "algorithm.distill.teacher: a server teacher's prompt log-probs are the model's at temperature 1"),
        (["algorithm.distill.teacher=/x", "algorithm.distill.timeout_s=5"], "algorithm.distill.timeout_s: only used by"),
        (["algorithm.distill.teacher=/x", "algorithm.distill.coef=0", "algorithm.distill.reward_coef=0"],
         "algorithm.distill: coef and reward_coef are both 0"),
    ]
    for extra, message in cases:
        with pytest.raises(UserError, match="^" + message.replace("(", r"\(")):
            load_config(None, ["task=arith", "algorithm.distill.coef=1", *extra])


@pytest.mark.slow
def test_a_run_distills_the_teacher_stage_into_every_trained_token(arith_dir: Path, tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(None, [
        "task=arith", f"model.path={arith_dir}", f"algorithm.distill.teacher={arith_dir}", "algorithm.distill.coef=2",
        "workflow.mode=sync", "train.max_steps=3", "train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=4",
        "eval.size=16", "eval.every=0", "logging.progress=false", "train.lr=0.01"])
    summary = train(cfg, tmp_path / "run", progress_enabled=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    # step 1 samples the teacher's own weights: log mu = log teacher on every token (same passes)
    assert abs(train_rows[0]["distill_reverse_kl"]) < 1e-4
    assert train_rows[-1]["distill_reverse_kl"] > 1e-3  # the student has moved off the teacher since
    assert summary["samples"] == 48 and summary["accounting"]["lost"] == 0
