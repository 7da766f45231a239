"""FSDP ranks as Ray actors (gloo on CPU, 2 ranks on the session's Ray) against the local ranks: the
same shares through the same FSDP code on the same CPU, so the results must be bit-identical."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.algorithms.losses import LossSettings, make_loss_fn
from asyncflow.engines.fsdp_train import FSDPTrainEngine
from asyncflow.runtime.ray_fsdp import RayFSDPTrainEngine, start_ray_fsdp

pytestmark = pytest.mark.ray

# 2 mini-batches of 3 rows: ranks get 2 and 1 rows; micro-batches of 1 make rank 1 run a dummy pass
SETTINGS: dict[str, Any] = dict(world_size=2, lr=1e-2, mini_batches=2, micro_batch_size=1, timeout_s=60)


def _on_ray(model_dir: Path) -> RayFSDPTrainEngine:
    # num_cpus=0: the session's Ray has 2 CPUs, and the ranks need none reserved to be placed
    return start_ray_fsdp(model_dir, actor_options=[{"num_cpus": 0}] * 2, start_timeout_s=120, **SETTINGS)


def _assert_equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _dies_within(ray: Any, actor: Any, limit_s: float) -> bool:
    """Whether `actor` is dead within `limit_s` (`ray.kill` only asks for it: a call may still get through)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=limit_s)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def model_dir(tiny_model, tmp_path: Path) -> Path:
    copy.deepcopy(tiny_model).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_ray_ranks_compute_what_local_ranks_compute(train_batch, ray_session, model_dir: Path) -> None:
    batch = train_batch()
    local = FSDPTrainEngine(model_dir, **SETTINGS)
    remote = _on_ray(model_dir)
    try:
        assert torch.equal(remote.logprobs(batch, 0.7), local.logprobs(batch, 0.7))
        loss_fn = make_loss_fn(LossSettings(loss="ppo", agg="token_mean"))
        got, want = remote.train_step(batch, loss_fn, 1.0), local.train_step(batch, loss_fn, 1.0)
        assert got == want and got["grad_norm"] > 0
        weights = remote.export_weights()
        _assert_equal_weights(weights, local.export_weights())
        # the weights as rank 0's object, for the rollout actors: the same dict, never through this process
        ref = remote.export_weights_ref()
        assert isinstance(ref, ray_session.ObjectRef)
        _assert_equal_weights(ray_session.get(ref, timeout=60), weights)
        # an extra command on every rank (as the runtime's weight broadcast will be)
        assert remote.call_ranks("export", [(False,)] * 2, "gather the weights")[1] is None
        where = remote.placement()
        assert [w["rank"] for w in where] == [0, 1] and len({w["pid"] for w in where}) == 2
        assert {w["node_id"] for w in where} == {ray_session.get_runtime_context().get_node_id()}
    finally:
        remote.close()
        local.close()


def test_a_fresh_ray_engine_resumes_a_checkpoint_exactly(train_batch, ray_session, model_dir: Path, tmp_path: Path) -> None:
    batch = train_batch(seed=1)
    loss_fn = make_loss_fn(LossSettings())
    first = _on_ray(model_dir)
    try:
        first.train_step(batch, loss_fn, 1.0)  # an optimizer state worth restoring
        first.save(str(tmp_path / "ckpt"), with_optimizer=True)
        resumed = _on_ray(tmp_path / "ckpt")
        try:
            resumed.load_optimizer(str(tmp_path / "ckpt"))
            assert resumed.train_step(batch, loss_fn, 1.0) == first.train_step(batch, loss_fn, 1.0)
            _assert_equal_weights(resumed.export_weights(), first.export_weights())
        finally:
            resumed.close()
    finally:
        first.close()


def test_a_killed_rank_actor_is_an_error_naming_its_rank_not_a_hang(train_batch, ray_session, model_dir: Path) -> None:
    engine = _on_ray(model_dir)
    try:
        survivor, victim = engine._links.actors  # type: ignore[union-attr]
        ray_session.kill(victim, no_restart=True)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 died .*killed by ray.kill.* compute log-probs"):
            engine.logprobs(train_batch(4), 1.0)
        assert time.monotonic() - start < 30  # loose: the point is an error, not a wait for timeout_s
        # the survivor is killed too (it would wait in a collective), and the engine says it is closed
        assert _dies_within(ray_session, survivor, 30.0)
        with pytest.raises(RuntimeError, match="closed"):
            engine.logprobs(train_batch(4), 1.0)
    finally:
        engine.close()


def test_a_rank_s_error_names_the_rank_and_carries_its_traceback(train_batch, ray_session, model_dir: Path) -> None:
    engine = _on_ray(model_dir)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)rank \d failed to load the optimizer state:.*FileNotFoundError"):
            engine.load_optimizer("/nonexistent/ckpt")
        with pytest.raises(RuntimeError, match="closed"):  # every rank was stopped with it
            engine.logprobs(train_batch(4), 1.0)
    finally:
        engine.close()


def test_a_start_that_does_not_finish_in_time_is_a_timeout_naming_the_ranks(ray_session, model_dir: Path) -> None:
    from asyncflow.errors import WaitTimeout

    with pytest.raises(WaitTimeout, match=r"rank\(s\) \[0\] to start"):
        start_ray_fsdp(model_dir, actor_options=[{"num_cpus": 0}] * 2, start_timeout_s=0.01, **SETTINGS)
