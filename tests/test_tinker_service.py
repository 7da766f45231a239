"""`asyncflow tinker-serve` driven by the official `tinker` SDK on loopback, on the tiny arith model:
the calls of tinker-cookbook's basic supervised and RL loops (training clients, losses, optimizer
steps, samplers, saves and loads), two clients on one base model, and the error shape.

`tinker` is in the test extra: this module fails at import without it (no skip)."""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from asyncflow.cli import main
from asyncflow.errors import UserError
from asyncflow.tinker.build import make_service
from asyncflow.tinker.sampling import SamplingPool, Snapshot
from asyncflow.tinker.server import start
from asyncflow.tinker.settings import ServeSettings
from asyncflow.tinker.training import TrainingModels

BASE = "tiny-base"  # the name the clients ask for (the service trains whatever folder it serves)
PROMPT = [1, 5, 9, 4, 7]


@contextmanager
def served(serve_dir: Path, state_dir: Path | None = None, **settings: Any) -> Iterator[str]:
    """A service of its own on a free loopback port, stopped on exit (the SDK's telemetry off: it would
    post batches too)."""
    os.environ["TINKER_TELEMETRY"] = "0"
    service = make_service(ServeSettings(serve_dir, device="cpu", **settings), state_dir=state_dir)
    server, _ = start(service, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        service.shutdown()


@pytest.fixture(scope="module")
def base_url(serve_dir: Path) -> Iterator[str]:
    with served(serve_dir) as url:
        yield url


@pytest.fixture(scope="module")
def service_client(base_url: str) -> Iterator[Any]:
    with tinker.ServiceClient(base_url=base_url, api_key="tml-test") as client:  # (its exit: sessions/{id}/finish)
        yield client


def sft_batch() -> list[types.Datum]:
    rows = [[1, 5, 9, 4, 7, 3], [2, 6, 8, 10, 3], [1, 11, 12, 4, 13, 14, 3]]
    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": [0.0] + [1.0] * (len(r) - 2)})
            for r in rows]


def logprobs(client: Any, data: list[types.Datum]) -> list[np.ndarray]:
    out = client.forward(data, "cross_entropy").result()
    return [np.asarray(o["logprobs"].tolist()) for o in out.loss_fn_outputs]


def test_session_starts_and_get_info_names_the_base_model(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    info = tc.get_info()
    assert info.model_data.model_name == BASE and info.lora_rank == 4
    tokenizer = tc.get_tokenizer()  # (from the served folder, named by get_info's tokenizer_id)
    assert tokenizer.decode(tokenizer.encode("12+3=", add_special_tokens=False)) == "12+3="
    assert tc.model_id.endswith(":train:" + tc.model_id.rsplit(":", 1)[1])


def test_cross_entropy_steps_lower_the_loss_on_a_fixed_batch(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    data = sft_batch()
    first = tc.forward_backward(data, "cross_entropy").result()
    losses = [first.metrics["loss:sum"]]
    # loss:sum is -sum(weights * logprobs), the logprobs being one per input token
    lps = [np.asarray(o["logprobs"].tolist()) for o in first.loss_fn_outputs]
    weights = [np.asarray(d.loss_fn_inputs["weights"].tolist()) for d in data]
    assert [len(lp) for lp in lps] == [d.model_input.length for d in data]
    assert losses[0] == pytest.approx(-sum(float((w * lp).sum()) for w, lp in zip(weights, lps, strict=True)), rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=3e-3, eps=1e-8)).result()
    for _ in range(5):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=3e-3, eps=1e-8)).result()
    after = -sum(float((w * lp).sum()) for w, lp in zip(weights, logprobs(tc, data), strict=True))
    assert all(x > y for x, y in zip(losses, losses[1:] + [after], strict=True)) and after < 0.85 * losses[0], (losses, after)


def rl_datum(prompt: list[int], seq: Any, advantage: float) -> types.Datum:
    """The cookbook's RL datum: input = prompt + sampled[:-1], targets shifted, sampled tokens' logprobs
    and advantages (0 over the prompt)."""
    tokens, n = list(prompt) + list(seq.tokens), len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * n + list(seq.logprobs),
                                       "advantages": [0.0] * n + [advantage] * len(seq.tokens)})


def test_importance_sampling_with_positive_advantages_raises_the_sampled_tokens_logprobs(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, types.SamplingParams(max_tokens=4, seed=3)).result()
    data = [rl_datum(PROMPT, seq, 1.0) for seq in result.sequences]
    n = len(PROMPT) - 1
    before = logprobs(tc, data)
    for seq, lp in zip(result.sequences, before, strict=True):  # the sampler's logprobs are the trainer's
        np.testing.assert_allclose(lp[n:], seq.logprobs, atol=2e-3)
    for _ in range(3):
        out = tc.forward_backward(data, "importance_sampling").result()
        assert set(out.metrics) >= {"loss:sum"}
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    after = logprobs(tc, data)
    gains = [float(a[n:].sum() - b[n:].sum()) for a, b in zip(after, before, strict=True)]
    assert all(g > 0 for g in gains), gains


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_clipped_losses_train_towards_positive_advantages(service_client: Any, loss: str) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=3, seed=5)).result().sequences[0]
    data = [rl_datum(PROMPT, seq, 1.0)]
    before = logprobs(tc, data)[0][len(PROMPT) - 1:].sum()
    tc.forward_backward(data, loss).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert logprobs(tc, data)[0][len(PROMPT) - 1:].sum() > before


def test_two_training_clients_train_independent_adapters(service_client: Any) -> None:
    a = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    b = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    data = sft_batch()
    b_before, a_before = logprobs(b, data), logprobs(a, data)
    for x, y in zip(a_before, b_before, strict=True):  # (fresh adapters: both are the base model)
        np.testing.assert_allclose(x, y, atol=1e-5)
    b.forward_backward(data[:1], "cross_entropy").result()  # b's gradient, pending while a steps
    for _ in range(3):
        a.forward_backward(data, "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    for x, y in zip(logprobs(b, data), b_before, strict=True):
        np.testing.assert_array_equal(x, y)
    a_after = logprobs(a, data)
    assert sum(float(x.sum()) for x in a_after) > sum(float(x.sum()) for x in a_before)
    b.optim_step(types.AdamParams(learning_rate=3e-3)).result()  # b applies its own pending gradient only
    b_after = logprobs(b, data)
    assert float(b_after[0].sum()) > float(b_before[0].sum())
    assert not np.allclose(np.concatenate(b_after), np.concatenate(a_after), atol=1e-4)


def test_sampling_clients_return_tokens_logprobs_and_stop_reasons(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    tc.forward_backward(sft_batch(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    assert sampler.get_base_model() == BASE
    prompt = types.ModelInput.from_ints(PROMPT)
    res = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=4, temperature=1.0, seed=11)).result()
    assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
    for s in res.sequences:
        assert 1 <= len(s.tokens) <= 4 and len(s.logprobs) == len(s.tokens)
        assert all(lp <= 0 for lp in s.logprobs) and s.stop_reason in ("length", "stop")
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result().sequences[0]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0,
                                                             stop=[greedy.tokens[0]])).result().sequences[0]
    assert stopped.tokens == greedy.tokens[:1] and stopped.stop_reason == "stop"
    prompt_lps = sampler.compute_logprobs(prompt).result()
    assert len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    assert all(lp is not None and lp < 0 and math.isfinite(lp) for lp in prompt_lps[1:])
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), topk_sample_logprobs=3).result()
    last_two = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=2).result()
    assert last_two[:-2] == [None] * (len(PROMPT) - 2) and last_two[-2:] == pytest.approx(prompt_lps[-2:], abs=1e-5)
    # a named snapshot, then a sampling client from its path (create_sampling_session + GET samplers/{id})
    path = tc.save_weights_for_sampler("step1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/step1"
    again = tc.create_sampling_client(path).result()
    same = again.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result().sequences[0]
    assert same.tokens == greedy.tokens


def test_save_state_and_load_state_round_trip(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=6).result()
    data = sft_batch()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = logprobs(tc, data)
    path = tc.save_state("mid").result().path
    assert path == f"tinker://{tc.model_id}/weights/mid"
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert not np.allclose(np.concatenate(logprobs(tc, data)), np.concatenate(saved))
    with pytest.warns(FutureWarning, match="deprecated"):  # (the SDK's own warning; the call still works)
        tc.load_state_with_optimizer(path).result()
    for x, y in zip(logprobs(tc, data), saved, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)
    fresh = service_client.create_training_client_from_state_with_optimizer(path).result()
    for x, y in zip(logprobs(fresh, data), saved, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)
    for client in (tc, fresh):  # the same step from the same weights and Adam moments: the same result
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for x, y in zip(logprobs(tc, data), logprobs(fresh, data), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_checkpoints_in_a_state_dir_are_found_by_path_after_a_restart(serve_dir: Path, tmp_path: Path) -> None:
    """save_state and save_weights_for_sampler(name) under --state-dir: a second service on the same
    folder loads the adapter and the AdamW moments (its next step is the first service's) and samples
    from the named weights."""
    data, state_dir, prompt = sft_batch(), tmp_path / "state", types.ModelInput.from_ints(PROMPT)
    with served(serve_dir, state_dir=state_dir) as url, tinker.ServiceClient(base_url=url, api_key="tml-test") as client:
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=30).result()
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("s1").result().path
        sampler_path = tc.save_weights_for_sampler("w1").result().path
        saved = logprobs(tc, data)
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        stepped = logprobs(tc, data)
        prompt_lps = client.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
        first_id = tc.model_id
    assert len(list((state_dir / "weights").rglob("*.pt"))) == len(list((state_dir / "sampler_weights").rglob("*.pt"))) == 1
    with served(serve_dir, state_dir=state_dir) as url, tinker.ServiceClient(base_url=url, api_key="tml-test") as client:
        fresh = client.create_training_client_from_state_with_optimizer(state).result()
        assert fresh.model_id != first_id and fresh.get_info().model_data.model_name == BASE
        for x, y in zip(logprobs(fresh, data), saved, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-6)
        fresh.forward_backward(data, "cross_entropy").result()
        fresh.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        for x, y in zip(logprobs(fresh, data), stepped, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
        again = client.create_sampling_client(model_path=sampler_path).result().compute_logprobs(prompt).result()
        assert again[1:] == pytest.approx(prompt_lps[1:], abs=1e-5)
        with pytest.raises(tinker.BadRequestError, match="no such checkpoint"):
            client.create_training_client_from_state(state.replace("/s1", "/s2")).result()


def test_a_state_dir_that_cannot_be_a_folder_is_refused_with_the_option_named(serve_dir: Path, tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").write_text("a file")
    assert main(["tinker-serve", str(serve_dir), "--port", "0", "--state-dir", str(tmp_path / "taken")]) == 2
    assert "--state-dir" in capsys.readouterr().err


def cookbook_rest_client(client: Any) -> Any:
    """The RestClient as tinker-cookbook 0.6.1 gets one (a call this SDK warns is deprecated)."""
    with pytest.warns(FutureWarning, match="create_rest_client"):
        return client.create_rest_client()


def test_unsupported_rest_calls_and_unknown_runs_are_404s_naming_them(base_url: str) -> None:
    rest = tinker.RestClient(base_url=base_url, api_key="tml-test")
    with pytest.raises(tinker.NotFoundError) as caught:
        rest.publish_checkpoint_from_tinker_path("tinker://sess-x:train:0/weights/w").result()
    assert caught.value.status_code == 404
    assert "publish_checkpoint_from_tinker_path" in str(caught.value) and "not supported" in str(caught.value)
    with pytest.raises(tinker.NotFoundError, match="'sess-x:train:0': no such training run"):
        rest.get_training_run("sess-x:train:0").result()


def test_an_unsupported_loss_is_a_failed_future_naming_the_supported_ones(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    with pytest.raises(tinker.RequestFailedError, match="grpo.*cross_entropy"):
        tc.forward_backward(sft_batch(), "grpo").result()  # type: ignore[arg-type]


def test_the_command_serves_the_sdk_and_refuses_bad_options(serve_dir: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tinker-serve", str(tmp_path)]) == 2
    assert main(["tinker-serve", str(serve_dir), "--max-staleness", "-1"]) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tinker-serve", str(serve_dir), "--device", "cuda"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3, errors  # (one line each)
    assert "no config.json" in errors[0] and "--max-staleness -1" in errors[1] and "--device cuda" in errors[2]
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow", "tinker-serve", str(serve_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "TINKER_TELEMETRY": "0"})
    try:
        assert proc.stdout is not None
        deadline, line = time.monotonic() + 120, ""
        while "listening on" not in line and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        found = re.search(r"listening on (http://\S+)", line)
        assert found, f"no 'listening on' line within 120 s (last line: {line!r})"
        with tinker.ServiceClient(base_url=found.group(1), api_key="tml-test") as client:
            tc = client.create_lora_training_client(base_model=BASE, rank=2).result()
            assert tc.get_info().model_data.model_name == BASE
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_forward_backward_custom_trains_through_the_cross_entropy_path(service_client: Any) -> None:
    """The SDK's client-side custom loss: a forward, then a backward with weights = -dLoss/dlogprobs."""
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=8).result()
    data = sft_batch()

    def loss_fn(batch: list[types.Datum], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -sum(lp[1:].sum() for lp in lps)  # (the same as cross_entropy with these weights)
        return loss, {"tokens:sum": float(sum(len(lp) - 1 for lp in lps))}

    before = sum(float(lp[1:].sum()) for lp in logprobs(tc, data))
    out = tc.forward_backward_custom(data, loss_fn).result()
    assert out.metrics["loss:sum"] == pytest.approx(-before, rel=1e-4)
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(-before, rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    assert sum(float(lp[1:].sum()) for lp in logprobs(tc, data)) > before


def test_gspo_with_the_sampled_tokens_in_the_ratio_trains_towards_positive_advantages(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=12).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=3, seed=6)).result().sequences[0]
    plain = rl_datum(PROMPT, seq, 1.0)
    n = len(PROMPT) - 1
    mask = [0.0] * n + [1.0] * len(seq.tokens)  # (as tinker-cookbook's rl_loop.py marks it)
    data = [types.Datum(model_input=plain.model_input, loss_fn_inputs={**plain.loss_fn_inputs, "sequence_ratio_mask": mask})]
    before = logprobs(tc, data)[0]
    out = tc.forward_backward(data, "gspo").result()
    s = math.exp(float(np.mean(before[n:] - np.asarray(seq.logprobs))))  # ~1: on-policy, inside the clip
    assert out.metrics["loss:sum"] == pytest.approx(-s * len(seq.tokens), rel=1e-3)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert logprobs(tc, data)[0][n:].sum() > before[n:].sum()


def with_cookbook_provenance(datum: types.Datum, prompt_len: int, sampled_len: int, sequence_id: str) -> types.Datum:
    """Provenance as tinker-cookbook's rl/data_processing.py attaches it to a one-turn trajectory's datum:
    a prompt run and a sampled run over the full sequence, the input's without its last position and
    the targets' without its first."""
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_len)]
        + ([types.SampledProvenanceSpan(sequence_id=sequence_id, length=sampled_len - 1)] if sampled_len > 1 else []),
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=prompt_len - 1),
                        types.SampledProvenanceSpan(sequence_id=sequence_id, length=sampled_len)])


def test_stable_reinforce_trains_on_sequences_sampled_with_stability_info(service_client: Any) -> None:
    """loss = -sum(min(w, 1) A lp) + kl_coeff sum(w - 1 - log w) over the sampled targets, w the ratio
    to the sampler's recorded log-prob; the sampled tokens' log-probs rise with A = 1."""
    tc = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=11).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    group = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=7)).result().sequences
    assert len({s.sequence_id for s in group}) == 2 and all(s.sequence_id for s in group)
    data = [with_cookbook_provenance(rl_datum(PROMPT, s, 1.0), len(PROMPT), len(s.tokens), s.sequence_id) for s in group]
    n = len(PROMPT) - 1
    before = logprobs(tc, data)
    out = tc.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}).result()
    want = 0.0
    for s, lp in zip(group, before, strict=True):
        log_w = lp[n:] - np.asarray(s.logprobs)
        w = np.exp(log_w)
        want += float(-(np.minimum(w, 1.0) * lp[n:]).sum() + 0.1 * (w - 1 - log_w).sum())
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    after = logprobs(tc, data)
    assert all(a[n:].sum() > b[n:].sum() for a, b in zip(after, before, strict=True))


def test_stable_reinforce_refuses_a_datum_without_recorded_provenance(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=13).result()
    sampler = tc.save_weights_and_get_sampling_client().result()  # (record_stability_info off)
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2, seed=1)).result().sequences[0]
    datum = rl_datum(PROMPT, seq, 1.0)
    with pytest.raises(tinker.BadRequestError, match=f"sequence_id '{seq.sequence_id}' has no stability info"):
        tc.forward_backward([with_cookbook_provenance(datum, len(PROMPT), len(seq.tokens), seq.sequence_id)],
                            "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="datum 0 has no provenance"):
        tc.forward_backward([datum], "stable_reinforce").result()


def test_an_rl_loop_as_the_cookbook_writes_it_raises_the_reward(service_client: Any) -> None:
    """rl_loop.py's calls per iteration: a sampler from the current weights, a group of samples per
    prompt, advantages = reward - the group's mean, importance_sampling, optim_step. Reward 1 for
    sampling token GOOD; the policy's expected reward, p(GOOD | prompt), is read exactly through
    compute_logprobs each iteration."""
    good, prompts = 7, [[1, 5, 9], [2, 6, 8, 10]]
    tc = service_client.create_lora_training_client(base_model=BASE, rank=8, seed=9).result()
    expected = []
    for step in range(8):
        sampler = tc.save_weights_and_get_sampling_client().result()
        expected.append(sum(math.exp(sampler.compute_logprobs(types.ModelInput.from_ints(p + [good])).result()[-1])
                            for p in prompts) / len(prompts))
        futures = [sampler.sample(types.ModelInput.from_ints(p), 32, types.SamplingParams(max_tokens=1, seed=100 * step + i))
                   for i, p in enumerate(prompts)]
        data = []
        for prompt, future in zip(prompts, futures, strict=True):
            group = future.result().sequences
            rewards = [float(good in s.tokens) for s in group]
            mean = sum(rewards) / len(rewards)
            data += [rl_datum(prompt, s, r - mean) for s, r in zip(group, rewards, strict=True) if r != mean]
        if data:  # (a step where every sample scored the same has nothing to learn from)
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    assert expected[-1] > 2 * expected[0], expected


def test_a_training_request_sent_twice_with_one_seq_id_runs_once(service_client: Any, base_url: str) -> None:
    """The SDK re-sends a submit whose answer timed out; the copy gets the first one's future."""
    import json
    import urllib.request

    from tinker.proto import tinker_public_pb2 as pb

    tc = service_client.create_lora_training_client(base_model=BASE, rank=2, seed=10).result()
    msg = pb.ForwardBackwardRequest(model_id=tc.model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, 2, 3], np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].dense = np.asarray([2, 3, 4], np.int64).tobytes()
    datum.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    datum.loss_fn_inputs["target_tokens"].shape.append(3)

    def post(route: str, body: bytes, kind: str) -> dict[str, Any]:
        req = urllib.request.Request(f"{base_url}/api/v1/{route}", body, {"Content-Type": kind, "X-API-Key": "tml-test"})
        with urllib.request.urlopen(req, timeout=30) as reply:
            return json.loads(reply.read())  # type: ignore[no-any-return]

    first, again = (post("forward_backward", msg.SerializeToString(), "application/x-protobuf") for _ in range(2))
    assert first["request_id"] == again["request_id"]
    step = json.dumps({"model_id": tc.model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}).encode()
    assert post("optim_step", step, "application/json") == post("optim_step", step, "application/json")
    other = pb.ForwardBackwardRequest()
    other.CopyFrom(msg)
    other.seq_id = 3
    assert post("forward_backward", other.SerializeToString(), "application/x-protobuf")["request_id"] != first["request_id"]


def test_clients_of_two_sessions_training_at_once_get_what_each_would_alone(service_client: Any, base_url: str) -> None:
    import threading

    data_a, data_b = sft_batch()[:2], sft_batch()[2:]

    def train(client: Any, data: list[types.Datum], out: list[Any]) -> None:
        for _ in range(3):
            client.forward_backward(data, "cross_entropy").result()
            client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        out.append(logprobs(client, data))

    alone: list[Any] = []
    train(service_client.create_lora_training_client(base_model=BASE, rank=4, seed=20).result(), data_a, alone)
    together: list[Any] = []
    with tinker.ServiceClient(base_url=base_url, api_key="tml-test") as other:
        a = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=20).result()
        b = other.create_lora_training_client(base_model=BASE, rank=4, seed=21).result()
        threads = [threading.Thread(target=train, args=(c, d, together)) for c, d in ((a, data_a), (b, data_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(together) == 2, "a training thread did not finish within 120 s"
    # the other session has finished (its client closed): this one's client goes on
    mine = logprobs(a, data_a)
    for x, y in zip(mine, alone[0], strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_a_malformed_body_is_a_400_with_a_detail(base_url: str) -> None:
    import json
    import urllib.error
    import urllib.request

    for route, body in (("create_model", b"[1, 2]"), ("forward_backward", b"not a protobuf \xff"), ("get_info", b"{}")):
        req = urllib.request.Request(f"{base_url}/api/v1/{route}", body, {"Content-Type": "application/json",
                                                                         "X-API-Key": "tml-test"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        assert caught.value.code == 400, route
        assert json.loads(caught.value.read())["detail"], route


def test_only_the_newest_sampling_sessions_are_kept(serve_dir: Path) -> None:
    pool = SamplingPool(serve_dir, None, [1], 0, max_sessions=2)
    for i in range(3):
        pool.add(f"s{i}", Snapshot(BASE, None))
    with pytest.raises(UserError, match="only the newest 2"):
        pool.get("s0")
    assert [pool.get(f"s{i}").base_model for i in (1, 2)] == [BASE, BASE]
    pool.shutdown()


def test_train_attn_and_train_mlp_choose_the_layers_an_adapter_covers(serve_dir: Path, service_client: Any) -> None:
    models = TrainingModels(serve_dir)
    models.create("attn", 2, 0, (True, False))
    models.create("mlp", 2, 0, (False, True))
    for model_id, part, other in (("attn", "self_attn", "mlp"), ("mlp", "mlp", "self_attn")):
        keys = [k for k in models.adapter(model_id) if "lora_A" in k]
        assert keys and all(part in k and other not in k for k in keys), (model_id, keys)
    with pytest.raises(UserError, match="trains no layer"):
        models.create("none", 2, 0, (False, False))
    models.shutdown()
    tc = service_client.create_lora_training_client(base_model=BASE, rank=2, train_attn=False).result()
    assert tc.forward_backward(sft_batch(), "cross_entropy").result().metrics["loss:sum"] > 0


def _prompt_logprobs(pool: SamplingPool, session_id: str) -> cf.Future[np.ndarray]:
    """The session's log-probs of PROMPT, as the service's compute_logprobs asks for them."""
    from tinker.proto import tinker_public_pb2 as pb

    request = {"sampling_session_id": session_id, "prompt": {"chunks": [{"tokens": PROMPT}]}, "num_samples": 1,
               "sampling_params": {"max_tokens": 1, "temperature": 0.0}, "prompt_logprobs": True}
    out: cf.Future[np.ndarray] = cf.Future()

    def parse(done: cf.Future[bytes]) -> None:
        msg = pb.SampleResponse()
        msg.ParseFromString(done.result())
        out.set_result(np.frombuffer(msg.prompt_logprobs, dtype=np.float32)[1:])

    pool.submit(request).add_done_callback(parse)
    return out


def test_one_engine_serves_sessions_in_turn_each_with_its_own_weights(serve_dir: Path) -> None:
    models = TrainingModels(serve_dir)
    models.create("attn", 2, 0, (True, False))
    models.create("mlp", 2, 1, (False, True))
    with torch.no_grad():  # (adapters that change the model: B starts at 0)
        for model_id in ("attn", "mlp"):
            for p in models.clients[model_id].params:
                p.add_(0.5 * torch.randn_like(p))
    snapshots = {"base": Snapshot(BASE, None), "attn": Snapshot(BASE, models.adapter("attn")),
                 "mlp": Snapshot(BASE, models.adapter("mlp"))}
    models.shutdown()
    alone = {}
    for name, snapshot in snapshots.items():  # each snapshot on an engine of its own
        pool = SamplingPool(serve_dir, None, [1], 0)
        pool.add(name, snapshot)
        alone[name] = _prompt_logprobs(pool, name).result(timeout=120)
        pool.shutdown()
    assert not np.allclose(alone["attn"], alone["base"]) and not np.allclose(alone["mlp"], alone["attn"])
    shared = SamplingPool(serve_dir, None, [1], 0, max_engines=1)
    for name, snapshot in snapshots.items():
        shared.add(name, snapshot)
    for name in ("attn", "mlp", "base", "attn", "base", "mlp"):  # adapters of other layers, and none
        assert _prompt_logprobs(shared, name).result(timeout=120) == pytest.approx(alone[name], abs=1e-5), name
    assert shared.counts == {"engines_built": 1, "snapshot_loads": 6}
    # an engine in use is not reloaded: another session's request waits for it, then gets its own weights
    held = shared.acquire("attn")
    waiting = _prompt_logprobs(shared, "base")
    time.sleep(1.0)
    assert not waiting.done()
    shared.release(held)
    assert waiting.result(timeout=120) == pytest.approx(alone["base"], abs=1e-5)
    shared.shutdown()


@pytest.fixture(scope="module")
def stream_service(serve_dir: Path) -> Iterator[tuple[Any, Any]]:
    """A second service, streaming with samplers at most one step behind, and an SDK client of it."""
    os.environ["TINKER_TELEMETRY"] = "0"
    service = make_service(ServeSettings(serve_dir, device="cpu", max_staleness=1))
    server, _ = start(service, "127.0.0.1", 0)
    with tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.server_address[1]}", api_key="tml-test") as client:
        yield service, client
    server.shutdown()
    server.server_close()
    service.shutdown()


def _newest_snapshot(service: Any) -> Snapshot:
    return list(service.sampling.snapshots.values())[-1]


def test_streaming_samples_during_training_within_the_bound_and_trains_as_the_plain_loop(
        stream_service: tuple[Any, Any], service_client: Any) -> None:
    service, client = stream_service
    data = sft_batch()
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=21).result()
    first = tc.save_weights_and_get_sampling_client().result()
    assert (_newest_snapshot(service).version, _newest_snapshot(service).behind) == (0, 0)
    gate = threading.Event()
    service.training.submit(lambda: gate.wait(timeout=120))  # the training thread busy until the gate opens
    try:
        trained = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=30)  # answered, not yet run
        assert step.metrics["stream/steps_pending"] == 1.0
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=30)  # one version behind: allowed
        assert (_newest_snapshot(service).version, _newest_snapshot(service).behind) == (0, 1)
        prompt = types.ModelInput.from_ints(PROMPT)
        greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
        ahead = sampler.sample(prompt, 1, greedy).result(timeout=60)  # sampling while training waits
        assert ahead.sequences[0].tokens == first.sample(prompt, 1, greedy).result().sequences[0].tokens
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=30)
        behind = tc.save_weights_and_get_sampling_client()  # two versions behind: it waits for training
        with pytest.raises(cf.TimeoutError):
            behind.result(timeout=1.0)
    finally:
        gate.set()
    behind.result(timeout=120)
    assert _newest_snapshot(service).version >= 1 and _newest_snapshot(service).behind <= 1
    assert trained.result(timeout=120).metrics["loss:sum"] > 0
    # the same calls on the plain service give the same weights: streaming changes what samples see, not training
    plain = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=21).result()
    plain.forward_backward(data, "cross_entropy").result()
    for _ in range(2):
        plain.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert np.concatenate(logprobs(tc, data)) == pytest.approx(np.concatenate(logprobs(plain, data)), abs=1e-5)
    assert not np.allclose(np.concatenate(logprobs(tc, data)), np.concatenate(logprobs(
        service_client.create_lora_training_client(base_model=BASE, rank=4, seed=21).result(), data)))


def test_a_streamed_step_that_fails_after_its_answer_fails_the_clients_next_call(
        stream_service: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    service, client = stream_service
    tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    saved = tc.save_state("before").result().path

    def broken(model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(service.training, "optim_step", broken)
    tc.forward_backward(sft_batch(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=30)  # answered before it ran
    service.training.submit(lambda: None).result(timeout=60)  # (the training thread has run the step)
    with pytest.raises(tinker.BadRequestError, match="answered before it ran then failed.*out of memory"):
        tc.save_weights_and_get_sampling_client().result(timeout=60)
    for call in (lambda: tc.forward_backward(sft_batch(), "cross_entropy"), lambda: tc.save_state("after")):
        with pytest.raises(tinker.BadRequestError, match="answered before it ran then failed"):
            call().result(timeout=60)
    monkeypatch.undo()
    with pytest.warns(FutureWarning, match="deprecated"):  # (the SDK's warning; the call still works)
        tc.load_state(saved).result()  # a load gives the client known weights again
    assert tc.forward_backward(sft_batch(), "cross_entropy").result().metrics["loss:sum"] > 0


# ---------------------------------------------------------------- the REST API (RestClient)


def test_rest_client_reads_training_runs_with_their_user_metadata(serve_dir: Path) -> None:
    """Runs as the cookbook creates them (user_metadata naming the renderer) and reads them back by a
    checkpoint's path, both kinds; a client from a saved state keeps its source's metadata."""
    meta = {"renderer_name": "role_colon", "wandb_link": "none"}
    with served(serve_dir) as url, tinker.ServiceClient(base_url=url, api_key="tml-test",
                                                       user_metadata={"purpose": "test"}) as client:
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=40, user_metadata=meta).result()
        plain = client.create_lora_training_client(base_model=BASE, rank=2, seed=41).result()
        state = tc.save_state("s1").result().path
        sampler_path = tc.save_weights_for_sampler("w1").result().path
        resumed = client.create_training_client_from_state(state).result()
        tc.save_weights_and_get_sampling_client()
        rest = cookbook_rest_client(client)
        for path in (state, sampler_path):
            run = rest.get_training_run_by_tinker_path(path).result()
            assert run.training_run_id == tc.model_id and run.user_metadata == meta
            assert run.base_model == BASE and run.lora_rank == 4 and run.is_lora
        run = rest.get_training_run(tc.model_id).result()
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
        assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler_path
        assert rest.get_training_run(plain.model_id).result().user_metadata is None
        assert rest.get_training_run(resumed.model_id).result().user_metadata == meta
        listed = rest.list_training_runs().result()
        assert [r.training_run_id for r in listed.training_runs] == [resumed.model_id, plain.model_id, tc.model_id]
        assert listed.cursor.total_count == 3
        page = rest.list_training_runs(limit=1, offset=1).result()
        assert [r.training_run_id for r in page.training_runs] == [plain.model_id]
        assert (page.cursor.offset, page.cursor.limit, page.cursor.total_count) == (1, 1, 3)
        session_id = tc.model_id.split(":train:")[0]
        assert rest.list_sessions().result().sessions == [session_id]
        session = rest.get_session(session_id).result()
        assert session.training_run_ids == [tc.model_id, plain.model_id, resumed.model_id]
        assert session.user_metadata == {"purpose": "test"} and len(session.sampler_ids) == 1
        capabilities = rest.get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == [serve_dir.name]


def test_rest_client_lists_and_deletes_checkpoints_also_after_a_restart(serve_dir: Path, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with served(serve_dir, state_dir=state_dir) as url, tinker.ServiceClient(base_url=url, api_key="tml-test") as client:
        tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=42, user_metadata={"k": "v"}).result()
        first, second = tc.save_state("a").result().path, tc.save_state("b").result().path
        sampler_path = tc.save_weights_for_sampler("w").result().path
    with served(serve_dir, state_dir=state_dir) as url, tinker.ServiceClient(base_url=url, api_key="tml-test") as client:
        rest = tinker.RestClient(base_url=url, api_key="tml-test")
        assert rest.get_training_run_by_tinker_path(first).result().user_metadata == {"k": "v"}
        listed = rest.list_checkpoints(tc.model_id).result().checkpoints
        assert {c.tinker_path for c in listed} == {first, second, sampler_path}
        assert {c.checkpoint_id: c.checkpoint_type for c in listed} == {
            "weights/a": "training", "weights/b": "training", "sampler_weights/w": "sampler"}
        assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
        assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} == {first, second, sampler_path}
        rest.delete_checkpoint_from_tinker_path(first).result()
        rest.delete_checkpoint_from_tinker_path(sampler_path).result()
        assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [second]
        with pytest.raises(tinker.BadRequestError, match="no such checkpoint"):
            client.create_training_client_from_state(first).result()
        with pytest.raises(tinker.BadRequestError, match="no such sampler weights"):
            client.create_sampling_client(model_path=sampler_path).result()
        with pytest.raises(tinker.NotFoundError, match="no such checkpoint"):
            rest.delete_checkpoint_from_tinker_path(first).result()
        client.create_training_client_from_state(second).result()  # (the other one is still there)


def test_rest_client_deletes_a_checkpoint_kept_in_memory(service_client: Any) -> None:
    tc = service_client.create_lora_training_client(base_model=BASE, rank=4, seed=43).result()
    path = tc.save_state("gone").result().path
    rest = cookbook_rest_client(service_client)
    assert [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == ["weights/gone"]
    assert path in {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    with pytest.raises(tinker.BadRequestError, match="no such checkpoint"):
        service_client.create_training_client_from_state(path).result()
