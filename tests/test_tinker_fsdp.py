"""The Tinker training clients over FSDP2 ranks (`FSDPTrainingModels`, world_size 2, gloo on CPU) against
the one-process backend (`TrainingModels`) on the tiny arith model: the same calls give the same
log-probs, losses, metrics and adapters; saved states load across the two; the `tinker` SDK trains
and samples through a service built on it."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from asyncflow.engines import lora
from asyncflow.errors import UserError
from asyncflow.tinker.build import make_service
from asyncflow.tinker.fsdp_training import FSDPTrainingModels, split
from asyncflow.tinker.server import start
from asyncflow.tinker.settings import ServeSettings
from asyncflow.tinker.training import TrainingBackend, TrainingModels
from asyncflow.tinker.wire import Datum

ROWS = [[1, 5, 9, 4, 7, 3], [2, 6, 8, 10, 3], [1, 11, 12, 4, 13, 14, 3], [3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 2]]
# eps well above float32 noise: Adam scales a gradient of ~1e-7 (an entry that is zero but for summation
# order, which differs between one batch and two rank shares) up to a full step of either sign
ADAM = {"learning_rate": 1e-2, "eps": 1e-3, "weight_decay": 0.01, "grad_clip_norm": 5.0}
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def fsdp(serve_dir: Path) -> Iterator[FSDPTrainingModels]:
    """One set of rank processes for the module (each start loads the model on every rank)."""
    models = FSDPTrainingModels(serve_dir, world_size=2)
    yield models
    models.shutdown()


def sft(rows: list[list[int]]) -> list[Datum]:
    return [Datum(r[:-1], {"target_tokens": np.array(r[1:]), "weights": np.linspace(0.5, 1.0, len(r) - 1, dtype=np.float32)})
            for r in rows]


def rl(rows: list[list[int]]) -> list[Datum]:
    """Importance-sampling datums; the last one's targets are not its input shifted (the full-logits path)."""
    out = []
    for i, r in enumerate(rows):
        targets = np.array(r[1:]) if i < len(rows) - 1 else np.array(r[::-1][:-1])
        n = len(r) - 1
        out.append(Datum(r[:-1], {"target_tokens": targets, "logprobs": np.full(n, -3.0, dtype=np.float32),
                                  "advantages": np.linspace(-1.0, 1.0, n, dtype=np.float32)}))
    return out


# each step: (loss, datums); 5 datums split 3 + 2 over the ranks, 1 datum leaves rank 1 a dummy pass
STEPS = [("cross_entropy", sft(ROWS)), ("importance_sampling", rl(ROWS)), ("cross_entropy", sft(ROWS[:1])),
         ("importance_sampling", rl(ROWS[1:4]))]


def run_steps(models: TrainingBackend, model_id: str, steps: list[tuple[str, list[Datum]]]) -> list[Any]:
    """Each step: forward_backward, then optim_step; what each returned."""
    out = []
    for loss, data in steps:
        lps, metrics = models.forward_backward(model_id, loss, {}, data, False)
        out.append((lps, metrics["loss:sum"], models.optim_step(model_id, ADAM)))
    return out


def assert_same_results(got: list[Any], want: list[Any]) -> None:
    for (lps, loss, metrics), (lps_w, loss_w, metrics_w) in zip(got, want, strict=True):
        assert [len(x) for x in lps] == [len(x) for x in lps_w]
        for a, b in zip(lps, lps_w, strict=True):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
        assert loss == pytest.approx(loss_w, rel=1e-5)
        assert metrics.keys() == metrics_w.keys()
        assert metrics["optim/grad_norm"] == pytest.approx(metrics_w["optim/grad_norm"], rel=1e-4)


def assert_same_adapter(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same tensors and PEFT config (but its base_model_name_or_path, which PEFT sets for the first
    adapter of a model only)."""
    assert got.keys() == want.keys()
    configs = [{k: v for k, v in lora.adapter_config(s).items() if k != "base_model_name_or_path"} for s in (got, want)]
    assert configs[0] == configs[1]
    for k in got.keys() - {lora.ADAPTER_KEY}:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)


def test_datums_are_split_into_contiguous_shares_differing_by_at_most_one() -> None:
    data = sft(ROWS)
    assert [[d.tokens for d in s] for s in split(data, 2)] == [[d.tokens for d in data[:3]], [d.tokens for d in data[3:]]]
    assert [len(s) for s in split(data[:1], 2)] == [1, 0]
    assert [len(s) for s in split(data, 3)] == [2, 2, 1]


def test_interleaved_fsdp_clients_each_match_the_one_process_backend_alone(serve_dir: Path,
                                                                        fsdp: FSDPTrainingModels) -> None:
    want = {}
    for model_id, seed in (("a", 3), ("b", 4)):
        alone = TrainingModels(serve_dir)
        alone.create(model_id, 4, seed, (True, model_id == "a"))
        want[model_id] = (run_steps(alone, model_id, STEPS), alone.adapter(model_id))
    fsdp.create("a", 4, 3, (True, True))
    fsdp.create("b", 4, 4, (True, False))
    got: dict[str, list[Any]] = {"a": [], "b": []}
    for step in STEPS:  # a's step, then b's, in turn
        for model_id in ("a", "b"):
            got[model_id] += run_steps(fsdp, model_id, [step])
    for model_id in ("a", "b"):
        assert_same_results(got[model_id], want[model_id][0])
        assert_same_adapter(fsdp.adapter(model_id), want[model_id][1])


def test_forward_only_leaves_the_gradients_and_on_forward_sees_the_outputs_first(serve_dir: Path,
                                                                                fsdp: FSDPTrainingModels) -> None:
    one = TrainingModels(serve_dir)
    seen: list[Any] = []
    for models in (one, fsdp):
        models.create("fwd", 2, 7)
        models.forward_backward("fwd", "cross_entropy", {}, sft(ROWS[:3]), True)  # (no gradient)
        models.forward_backward("fwd", "cross_entropy", {}, sft(ROWS[3:]), False, on_forward=seen.append)
        models.forward_backward("fwd", "cross_entropy", {}, [], False)
        models.optim_step("fwd", ADAM)
    assert len(seen) == 2 and seen[0][1] == pytest.approx(seen[1][1], rel=1e-5)
    assert_same_adapter(fsdp.adapter("fwd"), one.adapter("fwd"))


def test_bad_input_is_a_user_error_and_the_ranks_keep_serving(fsdp: FSDPTrainingModels) -> None:
    fsdp.create("bad", 2, 0)
    with pytest.raises(UserError, match="needs loss_fn_inputs"):
        fsdp.forward_backward("bad", "importance_sampling", {}, sft(ROWS[:2]), False)
    with pytest.raises(UserError, match="vocabulary"):
        fsdp.forward_backward("bad", "cross_entropy", {}, sft([[1, 2, 10**6]]), False)
    with pytest.raises(UserError, match="no such training client"):
        fsdp.optim_step("nobody", ADAM)
    saved = fsdp.save("bad")
    key = next(iter(saved.tensors))
    saved.tensors[key] = saved.tensors[key][:1]
    with pytest.raises(UserError, match="do not fit"):
        fsdp.load("bad", saved, with_optimizer=False)
    lps, _ = fsdp.forward_backward("bad", "cross_entropy", {}, sft(ROWS[:2]), True)
    assert [len(x) for x in lps] == [len(r) - 1 for r in ROWS[:2]]


def test_states_saved_on_either_backend_load_on_the_other(serve_dir: Path, fsdp: FSDPTrainingModels) -> None:
    one = TrainingModels(serve_dir)
    fsdp.create("src", 4, 11)
    run_steps(fsdp, "src", STEPS[:2])
    saved = fsdp.save("src")
    one.create("dst", 4, None)
    one.load("dst", saved, with_optimizer=True)
    assert_same_adapter(one.adapter("dst"), fsdp.adapter("src"))
    # the optimizer state came along: one more step on each stays equal
    assert_same_results(run_steps(one, "dst", STEPS[2:3]), run_steps(fsdp, "src", STEPS[2:3]))
    back = one.save("dst")
    assert back.tensors.keys() == saved.tensors.keys()
    fsdp.create("back", 4, None)
    fsdp.load("back", back, with_optimizer=True)
    assert_same_results(run_steps(fsdp, "back", STEPS[3:]), run_steps(one, "dst", STEPS[3:]))
    assert_same_adapter(fsdp.adapter("back"), one.adapter("dst"))


def test_a_rank_that_dies_during_a_call_is_an_error_naming_it_and_stops_the_ranks(serve_dir: Path) -> None:
    models = FSDPTrainingModels(serve_dir, world_size=2, timeout_s=60.0)
    procs = models.links.procs  # type: ignore[union-attr]  (PipeLinks: local processes)
    try:
        models.create("x", 2, 0)
        os.kill(procs[0].pid, signal.SIGSTOP)  # rank 0 cannot answer: the next call waits on both ranks
        with cf.ThreadPoolExecutor(1) as pool:
            call = pool.submit(models.forward_backward, "x", "cross_entropy", {}, sft(ROWS), False)
            time.sleep(1.0)  # (the request on its way; a rank killed before it is named as dead alike)
            procs[1].kill()
            with pytest.raises(RuntimeError, match="rank 1 died"):
                call.result(timeout=60)
        with pytest.raises(RuntimeError, match="stopped"):
            models.optim_step("x", ADAM)
        procs[0].join(timeout=30)
        assert not procs[0].is_alive()
    finally:
        models.shutdown()


@pytest.mark.parametrize("max_staleness", [0, 1])  # 1: streaming (answered after the forward pass)
def test_the_sdk_trains_and_samples_through_a_service_on_fsdp_ranks(serve_dir: Path, max_staleness: int) -> None:
    os.environ["TINKER_TELEMETRY"] = "0"
    service = make_service(ServeSettings(serve_dir, device="cpu", max_staleness=max_staleness, trainer="fsdp",
                                         world_size=2))
    server, _ = start(service, "127.0.0.1", 0)
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.server_address[1]}", api_key="tml-test") as client:
            tc = client.create_lora_training_client(base_model="tiny-base", rank=8, seed=0).result()
            data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]), loss_fn_inputs={"target_tokens": r[1:]})
                    for r in ROWS[:3]]
            losses = []
            for _ in range(4):
                losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=3e-3, eps=1e-8)).result()
            assert all(x > y for x, y in zip(losses, losses[1:], strict=False)), losses
            sampler = tc.save_weights_and_get_sampling_client().result()
            out = sampler.sample(types.ModelInput.from_ints([1, 5, 9]), 2, types.SamplingParams(max_tokens=4, seed=1)).result()
            assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in out.sequences)
    finally:
        server.shutdown()
        server.server_close()
        service.shutdown()
