"""The distillation teacher (`algorithm.distill`): its log-probs of each sampled response's tokens.

Two kinds. A model folder runs in this process as the KL reference does (`ReferenceModel`: no
gradients, micro-batched, at the rollout temperature). A server is any OpenAI-compatible
`/v1/completions` that echoes prompt log-probs (`echo: true, logprobs: 0`: vLLM, asyncflow serve): each
prompt + response is sent as token ids and scored as a prompt, so the server never tokenizes.

Either way the teacher must share the policy's vocabulary: a teacher folder is checked at start-up
(`check_teacher_folder`), and the server's reply must echo back the very ids sent.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from asyncflow.engines.base import TrainBatch
from asyncflow.engines.http_client import HTTPError, request_json
from asyncflow.errors import RunFailed, UserError
from asyncflow.model_folder import check_model_dir

KEY = "algorithm.distill.teacher"


def check_teacher_folder(teacher: str | Path, policy_dir: Path) -> Path:
    """The teacher folder, if it is a model folder whose vocabulary is the policy's (same size, and
    the same token ids where both hold the same tokenizer file); else `UserError`."""
    folder = check_model_dir(teacher, key=KEY)
    sizes = [_vocab_size(f / "config.json") for f in (folder, Path(policy_dir))]
    if None not in sizes and sizes[0] != sizes[1]:
        raise UserError(f"{KEY}: {folder} has a vocabulary of {sizes[0]} tokens, the policy ({policy_dir}) one of "
                        f"{sizes[1]}: the teacher must score the policy's token ids (the same tokenizer)")
    for name in ("tokenizer.json", "vocab.json"):
        mine, theirs = (_vocabulary(f / name) for f in (Path(policy_dir), folder))
        if mine is not None and theirs is not None and mine != theirs:
            raise UserError(f"{KEY}: {folder / name} maps tokens to other ids than the policy's {policy_dir / name}: "
                            "the teacher must use the policy's tokenizer")
    return folder


def _vocab_size(config: Path) -> int | None:
    data = json.loads(config.read_text())  # (check_model_dir read it already)
    size = data.get("vocab_size", (data.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) else None


def _vocabulary(path: Path) -> Any:
    """A tokenizer file's token -> id mapping (None: no such file, or not readable as one)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if path.name == "tokenizer.json":
        model = data.get("model") if isinstance(data, dict) else None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        added = [(t.get("id"), t.get("content")) for t in data.get("added_tokens") or [] if isinstance(t, dict)]
        return None if vocab is None else (vocab, sorted(added, key=repr))
    return data


class ServerTeacher:
    """A teacher behind an OpenAI-compatible server: `await teacher(batch)` is the [B, L-1] log-probs
    of each row's tokens 1.. (as a trainer pass gives them), from one `/v1/completions` request that
    echoes the rows' prompt log-probs. The server's model is its first listed one."""

    def __init__(self, base_url: str, *, timeout_s: float, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token
        self.model: str | None = None

    async def __call__(self, batch: TrainBatch) -> torch.Tensor:
        rows = [batch.input_ids[i, : int(n)].tolist() for i, n in enumerate(batch.attention_mask.sum(-1))]
        if self.model is None:
            self.model = await self._model()
        body = {"model": self.model, "prompt": rows, "max_tokens": 1, "echo": True, "logprobs": 0,
                "temperature": 1.0}
        reply = await self._call("POST", "/completions", body)
        choices = reply.get("choices") if isinstance(reply, dict) else None
        by_index = {c.get("index", k): c for k, c in enumerate(choices or []) if isinstance(c, dict)}
        out = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
        for i, row in enumerate(rows):
            out[i, : len(row) - 1] = torch.tensor(self._prompt_logprobs(by_index.get(i), i, row))
        return out

    async def _model(self) -> str:
        reply = await self._call("GET", "/models", None)
        data = reply.get("data") if isinstance(reply, dict) else None
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise RunFailed(f"{KEY}: {self.base_url}/models lists no model")
        return str(data[0]["id"])

    async def _call(self, method: str, route: str, body: Any) -> Any:
        try:
            return await request_json(method, self.base_url + route, body, token=self.token,
                                      timeout=self.timeout_s, retry_safe=True)
        except (HTTPError, OSError) as exc:
            raise RunFailed(f"{KEY}: {method} {self.base_url}{route} failed: {exc}") from None

    def _prompt_logprobs(self, choice: Any, i: int, row: list[int]) -> list[float]:
        """`choice`'s (the reply's `i`th) log-probs of `row[1:]`, checked to be of exactly the ids sent."""
        where = f"{KEY}: {self.base_url}/completions choice {i}"
        try:
            lp = choice["logprobs"]
            values = lp["token_logprobs"][: len(row)]
        except (KeyError, TypeError):
            raise RunFailed(f"{where}: no echoed prompt log-probs (does the server support echo with "
                            "logprobs on /v1/completions?)") from None
        ids = choice.get("prompt_token_ids") or lp.get("token_ids")
        if isinstance(ids, list) and list(ids[: len(row)]) != row:
            raise RunFailed(f"{where}: echoed other token ids than sent (the server re-tokenized the prompt)")
        if len(values) < len(row) or any(not isinstance(v, (int, float)) or math.isnan(v) for v in values[1:]):
            raise RunFailed(f"{where}: {len(values)} prompt log-probs for {len(row)} tokens, or non-numbers")
        return [float(v) for v in values[1:]]
