"""`asyncflow serve` with the official `openai` SDK as the client (sync and async): streaming,
stop strings with exact token accounting, per-request seeds and top log-probs."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncflow.serve_main import make_app, start_http

openai = pytest.importorskip("openai")

CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from asyncflow.tasks.arith import make_model, make_tokenizer

    out = tmp_path_factory.mktemp("sdk") / "tiny-arith"
    tok = make_tokenizer()
    make_model(tok, seed=0, hidden=64).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    app = make_app(Path(out), model_name="tiny", token=None, max_batch=16)
    app.tok.chat_template = CHAT
    http, _ = start_http(app, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}/v1"
    finally:
        http.shutdown()
        http.server_close()
        app.engine.shutdown()


def _client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)


def test_the_same_seed_gives_the_same_sample_and_another_seed_another(base_url: str) -> None:
    c = _client(base_url)
    a, b, other = (c.completions.create(model="tiny", prompt="12+3=", max_tokens=12, seed=s) for s in (7, 7, 8))
    assert a.choices[0].text == b.choices[0].text and a.choices[0].token_ids == b.choices[0].token_ids
    assert other.choices[0].token_ids != a.choices[0].token_ids
    n = c.completions.create(model="tiny", prompt="12+3=", max_tokens=12, seed=7, n=2)  # choice k: seed + k
    assert n.choices[0].token_ids == a.choices[0].token_ids and n.choices[1].token_ids != a.choices[0].token_ids


def test_stop_strings_end_generation_and_the_tokens_cover_exactly_what_was_generated(base_url: str) -> None:
    c = _client(base_url)
    full = c.completions.create(model="tiny", prompt="12+3=", max_tokens=12, seed=7, logprobs=2)
    ids, text = full.choices[0].token_ids, full.choices[0].text
    assert len(ids) == 12 and len(text) == 12  # (a character tokenizer: one character per token)
    stop = text[5:7]
    first = text.find(stop)
    cut = c.completions.create(model="tiny", prompt="12+3=", max_tokens=12, seed=7, stop=[stop, "never"], logprobs=2)
    ch = cut.choices[0]
    assert ch.finish_reason == "stop" and ch.text == text[:first]
    # the ids kept are those up to the one completing the stop string, the same as the uncut run's
    assert ch.token_ids == ids[: first + len(stop)]
    assert ch.logprobs.token_logprobs == full.choices[0].logprobs.token_logprobs[: len(ch.token_ids)]
    assert cut.usage.completion_tokens == len(ch.token_ids)


def test_top_logprobs_are_the_sampled_distributions_alternatives(base_url: str) -> None:
    c = _client(base_url)
    r = c.completions.create(model="tiny", prompt="12+3=", max_tokens=4, seed=1, logprobs=20, temperature=0.5)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 4 and all(len(t) == 20 for t in lp.top_logprobs)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        values = list(top.values())
        assert values == sorted(values, reverse=True) and math.isclose(top.get(token, chosen), chosen, abs_tol=1e-5)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=3,
                                     logprobs=True, top_logprobs=3, seed=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].token_ids) and all(len(t.top_logprobs) == 3 for t in content)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.completions.create(model="tiny", prompt="1", logprobs=21)


def test_streams_match_the_unstreamed_reply_token_for_token(base_url: str) -> None:
    c = _client(base_url)
    ref = c.completions.create(model="tiny", prompt="12+3=", max_tokens=10, seed=5, stop=["zz9"])
    chunks = list(c.completions.create(model="tiny", prompt="12+3=", max_tokens=10, seed=5, stop=["zz9"],
                                       stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == len(ref.choices[0].token_ids) and not chunks[-1].choices
    body = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(body) > 3  # a chunk per token, not one reply at the end
    assert "".join(ch.text for ch in body) == ref.choices[0].text
    assert [t for ch in body for t in (ch.model_extra or {}).get("token_ids", [])] == ref.choices[0].token_ids
    assert body[-1].finish_reason == ref.choices[0].finish_reason

    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=6,
                                     seed=3, stream=True)
    parts = list(chat)
    assert parts[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in parts)
    whole = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}], max_tokens=6, seed=3)
    assert text == whole.choices[0].message.content and parts[-1].choices[0].finish_reason is not None


def test_a_stream_that_stops_never_shows_the_stop_text(base_url: str) -> None:
    c = _client(base_url)
    text = c.completions.create(model="tiny", prompt="7+8=", max_tokens=12, seed=11).choices[0].text
    stop = text[4:7]
    parts = list(c.completions.create(model="tiny", prompt="7+8=", max_tokens=12, seed=11, stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in parts) == text[: text.find(stop)]
    assert parts[-1].choices[0].finish_reason == "stop"


def test_the_async_client_streams_concurrently_with_seeds(base_url: str) -> None:
    async def main() -> list[str]:
        c = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)

        async def one(seed: int) -> str:
            stream = await c.completions.create(model="tiny", prompt="3+4=", max_tokens=8, seed=seed, stream=True)
            return "".join([ch.choices[0].text async for ch in stream])

        try:
            return await asyncio.gather(*(one(s % 4) for s in range(8)))
        finally:
            await c.close()

    texts = asyncio.run(main())
    assert texts[:4] == texts[4:]  # same seed, same text, whatever else shares the batch
    sync = _client(base_url).completions.create(model="tiny", prompt="3+4=", max_tokens=8, seed=1)
    assert texts[1] == sync.choices[0].text
