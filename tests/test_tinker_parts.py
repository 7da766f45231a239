"""The parts of `asyncflow tinker-serve` that need no SDK: Tinker's losses against hand-computed values,
the stability records and the resolution of provenance spans, the future store's long-poll and
retention, and the files of the checkpoint and run stores."""

from __future__ import annotations

import concurrent.futures as cf
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncflow.errors import UserError
from asyncflow.tinker.checkpoints import PathStore
from asyncflow.tinker.futures import FutureStore
from asyncflow.tinker.losses import loss_fn
from asyncflow.tinker.rest import NotFound, RestApi
from asyncflow.tinker.runs import RunStore
from asyncflow.tinker.stability import (
    RECORDED_LOGPROBS,
    SAMPLED,
    Record,
    SequenceRecords,
    add_stability_inputs,
)
from asyncflow.tinker.wire import Datum, Span

LP = [math.log(0.5), math.log(0.2), math.log(0.9)]
Q = [math.log(0.25), math.log(0.2), math.log(0.6)]  # ratios r = 2.0, 1.0, 1.5
ADV = [1.0, -2.0, -1.0]


def run(name: str, inputs: dict[str, list[float]], config: dict[str, float] | None = None) -> tuple[float, list[float]]:
    """The loss and its gradient with respect to the log-probs."""
    lp = torch.tensor(LP, requires_grad=True)
    loss = loss_fn(name)(lp, {k: np.asarray(v, np.float32) for k, v in inputs.items()}, config or {})
    loss.backward()
    assert lp.grad is not None
    return float(loss.detach()), lp.grad.tolist()


def test_cross_entropy_is_the_weighted_negative_log_likelihood_summed() -> None:
    loss, grad = run("cross_entropy", {"target_tokens": [1, 2, 3], "weights": [0.0, 1.0, 2.0]})
    assert loss == pytest.approx(-(LP[1] + 2 * LP[2]), rel=1e-6)
    assert grad == pytest.approx([0.0, -1.0, -2.0])


def test_importance_sampling_weights_each_advantage_by_its_ratio() -> None:
    loss, grad = run("importance_sampling", {"target_tokens": [1, 2, 3], "logprobs": Q, "advantages": ADV})
    assert loss == pytest.approx(-(2.0 * 1 + 1.0 * -2 + 1.5 * -1), rel=1e-5)
    assert grad == pytest.approx([-2.0, 2.0, 1.5], rel=1e-5)  # d(-r A)/d lp = -r A


def test_ppo_clips_the_ratio_on_the_side_that_would_overshoot() -> None:
    inputs = {"target_tokens": [1, 2, 3], "logprobs": Q, "advantages": ADV}
    loss, grad = run("ppo", inputs)
    # r = 2 with A > 0: clipped at 1.2, no gradient; r = 1: unclipped; r = 1.5 with A < 0: min picks r A
    assert loss == pytest.approx(-(1.2 * 1 + 1.0 * -2 + 1.5 * -1), rel=1e-5)
    assert grad == pytest.approx([0.0, 2.0, 1.5], rel=1e-5)
    loose, _ = run("ppo", inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0})
    assert loose == pytest.approx(-(2.0 - 2.0 - 1.5), rel=1e-5)


def test_cispo_scales_the_log_prob_gradient_by_the_clipped_ratio_without_differentiating_it() -> None:
    loss, grad = run("cispo", {"target_tokens": [1, 2, 3], "logprobs": Q, "advantages": ADV})
    clipped = [1.2, 1.0, 1.2]
    assert loss == pytest.approx(-sum(c * lp * a for c, lp, a in zip(clipped, LP, ADV, strict=True)), rel=1e-5)
    assert grad == pytest.approx([-c * a for c, a in zip(clipped, ADV, strict=True)], rel=1e-5)


def test_dro_needs_beta_and_penalizes_the_squared_log_ratio() -> None:
    inputs = {"target_tokens": [1, 2, 3], "logprobs": Q, "advantages": ADV}
    with pytest.raises(UserError, match="beta"):
        run("dro", inputs)
    loss, _ = run("dro", inputs, {"beta": 0.5})
    want = -sum(lp * a - 0.25 * (lp - q) ** 2 for lp, q, a in zip(LP, Q, ADV, strict=True))
    assert loss == pytest.approx(want, rel=1e-5)


def test_gspo_gives_every_token_the_clipped_length_normalized_sequence_ratio() -> None:
    inputs = {"target_tokens": [1, 2, 3], "logprobs": Q, "advantages": ADV, "sequence_ratio_mask": [0.0, 1.0, 1.0]}
    loss, grad = run("gspo", inputs)
    s = math.sqrt(1.5)  # exp(mean(log 1, log 1.5)) over the marked tokens; position 0 is not in the ratio
    # s = 1.22 > 1.2: A = 1 takes the clipped 1.2 (no gradient); A < 0 takes s A, gradient -A s
    assert loss == pytest.approx(-(1.2 * 1 + s * -2 + s * -1), rel=1e-5)
    assert grad == pytest.approx([0.0, 2 * s, s], rel=1e-5)
    loose, loose_grad = run("gspo", inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})
    assert loose == pytest.approx(-s * sum(ADV), rel=1e-5) and loose_grad == pytest.approx([-s * a for a in ADV], rel=1e-5)
    with pytest.raises(UserError, match="sequence_ratio_mask"):
        run("gspo", {**inputs, "sequence_ratio_mask": [0.0, 0.0, 0.0]})
    with pytest.raises(UserError, match="sequence_ratio_mask"):
        run("gspo", {"target_tokens": [1, 2, 3], "logprobs": Q, "advantages": ADV})


def test_stable_reinforce_truncates_the_recorded_ratio_at_one_over_the_sampled_targets() -> None:
    # targets 0 and 1 sampled (w = 2 and 1, both weighted 1), target 2 a prompt token (no loss)
    inputs = {"target_tokens": [1, 2, 3], "advantages": ADV, RECORDED_LOGPROBS: Q, SAMPLED: [1.0, 1.0, 0.0]}
    loss, grad = run("stable_reinforce", inputs)
    assert loss == pytest.approx(-(LP[0] * 1 + LP[1] * -2), rel=1e-5)
    assert grad == pytest.approx([-1.0, 2.0, 0.0], rel=1e-5)
    # kl_coeff * sum(w - 1 - log w): its gradient is kl_coeff * (w - 1)
    loss, grad = run("stable_reinforce", inputs, {"kl_coeff": 0.5})
    assert loss == pytest.approx(-(LP[0] - 2 * LP[1]) + 0.5 * (2.0 - 1 - math.log(2.0)), rel=1e-5)
    assert grad == pytest.approx([-1.0 + 0.5, 2.0, 0.0], rel=1e-5)


def recorded(records: SequenceRecords) -> None:
    """seq-a: prompt [1, 5, 9], sampled [4, 7, 3]."""
    records.add("seq-a", Record(np.asarray([1, 5, 9]), np.asarray([4, 7, 3]), np.asarray([-0.5, -1.0, -2.0], np.float32)))


def test_provenance_resolves_each_sampled_target_to_its_recorded_logprob() -> None:
    records = SequenceRecords()
    recorded(records)
    full = [1, 5, 9, 4, 7, 3]  # (the cookbook's datum: input full[:-1], targets full[1:], spans shifted to match)
    datum = Datum(full[:-1], {"target_tokens": np.asarray(full[1:])},
                  input_spans=[Span(False, "seq-a", 0, 3), Span(True, "seq-a", 0, 2)],
                  target_spans=[Span(False, "seq-a", 1, 2), Span(True, "seq-a", 0, 3)])
    add_stability_inputs([datum], records)
    assert datum.inputs[SAMPLED].tolist() == [0, 0, 1, 1, 1]
    assert datum.inputs[RECORDED_LOGPROBS].tolist() == [0, 0, -0.5, -1.0, -2.0]
    wrong = Datum(full[:-1], {"target_tokens": np.asarray([5, 9, 4, 8, 3])}, datum.input_spans, datum.target_spans)
    with pytest.raises(UserError, match=r"datum 0: target_tokens 2..4 are not the tokens sampled as sequence 'seq-a'"):
        add_stability_inputs([wrong], records)
    with pytest.raises(UserError, match="datum 0 has no provenance"):
        add_stability_inputs([Datum(full[:-1], {"target_tokens": np.asarray(full[1:])})], records)


def test_only_the_newest_sequences_are_kept_and_a_use_makes_one_newest_again() -> None:
    records = SequenceRecords(max_sequences=2)
    record = Record(np.asarray([1]), np.asarray([2]), np.asarray([-0.1], np.float32))
    records.add("seq-1", record)
    records.add("seq-2", record)
    records.get("seq-1", "here")  # (seq-2 is now the oldest)
    records.add("seq-3", record)
    assert records.get("seq-1", "here") is record and len(records) == 2
    with pytest.raises(UserError, match="forward_backward: datum 4: sequence_id 'seq-2' has no stability info here"):
        records.get("seq-2", "forward_backward: datum 4")


def test_a_sequence_unused_for_longer_than_the_ttl_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("asyncflow.tinker.stability.time.monotonic", lambda: now[0])
    records = SequenceRecords(ttl_s=60.0)
    record = Record(np.asarray([1]), np.asarray([2]), np.asarray([-0.1], np.float32))
    records.add("seq-old", record)
    now[0] += 40.0
    records.add("seq-new", record)
    now[0] += 30.0  # (seq-old was recorded 70 s ago, seq-new 30 s ago)
    assert records.get("seq-new", "here") is record
    with pytest.raises(UserError, match="'seq-old' has no stability info.*0.0166667 h after its last use"):
        records.get("seq-old", "here")
    now[0] += 50.0  # (the get above made seq-new's last use 50 s ago)
    assert records.get("seq-new", "here") is record and len(records) == 1


def test_an_unknown_loss_names_the_supported_ones() -> None:
    with pytest.raises(UserError, match="'grpo' is not supported.*cross_entropy"):
        loss_fn("grpo")
    with pytest.raises(UserError, match="advantages"):
        run("importance_sampling", {"target_tokens": [1, 2, 3], "logprobs": Q})


def test_a_pending_future_is_polled_again_and_a_result_is_kept_for_every_poll() -> None:
    store = FutureStore(poll_s=0.01)
    future: cf.Future[int] = cf.Future()
    request_id = store.add("json", future)
    assert store.poll(request_id).state == "pending"
    future.set_result(7)
    assert [(p.state, p.value) for p in (store.poll(request_id), store.poll(request_id))] == [("done", 7)] * 2
    assert store.poll("req-unknown").state == "unknown"
    failed: cf.Future[int] = cf.Future()
    failed.set_exception(UserError("bad datum"))
    found = store.poll(store.add("json", failed))
    assert found.state == "failed" and str(found.value) == "bad datum"


def test_finished_results_past_the_cap_are_dropped_oldest_first() -> None:
    store = FutureStore(poll_s=0.01, max_kept=2)
    ids = [store.done("json", i) for i in range(4)]
    assert [store.poll(i).state for i in ids] == ["unknown", "unknown", "done", "done"]


def test_runs_in_a_folder_are_read_back_by_a_new_store_and_unreadable_files_skipped(tmp_path: Path) -> None:
    RunStore(tmp_path).add("sess-1:train:0", "base", 4, {"renderer_name": "r"})
    (tmp_path / "runs" / "junk.json").write_text("not json")
    later = RunStore(tmp_path)
    run = later.get("sess-1:train:0")
    assert run is not None and (run.base_model, run.lora_rank, run.user_metadata) == ("base", 4, {"renderer_name": "r"})
    assert [r.run_id for r in later.all()] == ["sess-1:train:0"] and later.get("junk") is None
    assert RunStore(None).get("sess-1:train:0") is None


def test_checkpoint_files_are_listed_by_path_and_a_deleted_one_is_gone(tmp_path: Path) -> None:
    store: PathStore[dict[str, int]] = PathStore(tmp_path, dict, dict)
    paths = ["tinker://sess-1:train:0/weights/a b", "tinker://sess-1:train:1/weights/%x"]
    for n, path in enumerate(paths):
        store[path] = {"n": n}
    assert sorted(e.path for e in PathStore(tmp_path, dict, dict).entries("weights")) == sorted(paths)
    del store[paths[0]]
    assert [e.path for e in store.entries("weights")] == [paths[1]] and paths[0] not in store
    with pytest.raises(KeyError):
        del store[paths[0]]


def test_rest_routes_tell_a_checkpoint_named_like_a_sub_call_from_the_unsupported_call() -> None:
    weights: PathStore[dict[str, int]] = PathStore(None, dict, dict)
    rest = RestApi(RunStore(None), weights, PathStore(None, dict, dict), {}, "m")
    weights["tinker://r:train:0/weights/publish"] = {"n": 1}
    with pytest.raises(NotFound, match="unpublish_checkpoint_from_tinker_path"):
        rest.answer("DELETE", "training_runs/r:train:0/checkpoints/weights/publish/publish", "")
    assert rest.answer("DELETE", "training_runs/r:train:0/checkpoints/weights/publish", "") == {}
    assert "tinker://r:train:0/weights/publish" not in weights
    with pytest.raises(UserError, match="limit"):
        rest.answer("GET", "checkpoints", "limit=x")
