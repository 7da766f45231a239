"""The parts of `asyncflow tinker-serve` that need no SDK: Tinker's losses against hand-computed values,
and the future store's long-poll and retention."""

from __future__ import annotations

import concurrent.futures as cf
import math

import numpy as np
import pytest
import torch

from asyncflow.errors import UserError
from asyncflow.tinker.futures import FutureStore
from asyncflow.tinker.losses import loss_fn

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


def test_an_unknown_loss_names_the_supported_ones() -> None:
    with pytest.raises(UserError, match="'gspo' is not supported.*cross_entropy"):
        loss_fn("gspo")
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
