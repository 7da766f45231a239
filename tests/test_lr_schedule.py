"""train.lr_schedule / warmup_ratio / min_lr_ratio and train.gradient_checkpointing in both train engines."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from asyncflow.algorithms.losses import LossSettings, make_loss_fn
from asyncflow.engines.lr_schedule import SCHEDULE_KEY, LrSchedule
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.errors import UserError
from asyncflow.workflow.batch import build_train_batch


def _batch(n: int = 4):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 32, (3 + i % 2,), generator=g).tolist() for i in range(n)]
    responses = [torch.randint(2, 32, (2 + i % 3,), generator=g).tolist() for i in range(n)]
    behavior = [[-1.0] * len(r) for r in responses]
    return build_train_batch(prompts, responses, behavior, torch.randn(n, generator=g), [True] * n, 0)


def test_each_schedule_gives_the_hand_computed_rates() -> None:
    # 10 optimizer steps, warmup ceil(10 x 0.15) = 2: steps 0 and 1 at 0 and lr/2
    def rates(kind: str, **kw) -> list[float]:
        s = LrSchedule(2.0, kind=kind, warmup_ratio=0.15, total_steps=10, **kw)
        return [s.lr * s.factor(i) for i in range(10)]

    assert rates("constant") == pytest.approx([0.0, 1.0] + [2.0] * 8)
    assert rates("linear") == pytest.approx([0.0, 1.0] + [2.0 * (10 - i) / 8 for i in range(2, 10)])
    assert rates("linear")[9] == pytest.approx(0.25)
    cosine = rates("cosine")
    assert cosine[:3] == pytest.approx([0.0, 1.0, 2.0])
    assert cosine[6] == pytest.approx(1.0)  # half way through the decay: lr/2
    assert cosine[4] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 2 / 8)))
    floor = rates("cosine", min_lr_ratio=0.1)
    assert floor[6] == pytest.approx(2.0 * (0.5 * 0.9 + 0.1))
    # no warmup: the first step runs at lr; per train step, mini_batches consecutive rates
    s = LrSchedule(1.0, kind="linear", total_steps=8, mini_batches=2)
    assert s.rates(0) == pytest.approx([1.0, 7 / 8]) and s.rates(3) == pytest.approx([2 / 8, 1 / 8])


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_the_rates_are_transformers_schedules_step_for_step(kind: str) -> None:
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup"}.get(kind, kind)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    hf = get_scheduler(name, opt, num_warmup_steps=math.ceil(23 * 0.1), num_training_steps=23)
    ours = LrSchedule(0.5, kind=kind, warmup_ratio=0.1, total_steps=23)
    for i in range(23):
        assert opt.param_groups[0]["lr"] == pytest.approx(ours.lr * ours.factor(i)), i
        opt.step()
        hf.step()


def test_the_torch_engine_applies_logs_and_resumes_the_schedule(tiny_model, tmp_path: Path) -> None:
    schedule = LrSchedule(1e-2, kind="linear", warmup_ratio=0.25, total_steps=8, mini_batches=2)
    loss_fn = make_loss_fn(LossSettings())
    engine = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-2, mini_batches=2, schedule=schedule)
    # optimizer steps 0..7: warmup 2 (0, lr/2), then lr x (8 - i) / 6; a train row logs its two steps' mean
    want = [1e-2 * f for f in (0.0, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6)]
    for step in range(2):
        metrics = engine.train_step(_batch(), loss_fn, 1.0)
        assert metrics["lr"] == pytest.approx((want[2 * step] + want[2 * step + 1]) / 2)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(want[3])  # the step's last optimizer step
    engine.save(str(tmp_path / "ckpt"), with_optimizer=True)
    resumed = TorchTrainEngine(tmp_path / "ckpt", lr=1e-2, mini_batches=2, schedule=schedule)
    resumed.load_optimizer(str(tmp_path / "ckpt"))
    assert resumed.steps_done == 2
    a, b = engine.train_step(_batch(), loss_fn, 1.0), resumed.train_step(_batch(), loss_fn, 1.0)
    assert a["lr"] == b["lr"] == pytest.approx((want[4] + want[5]) / 2)
    for k, v in engine.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[k], v)
    # a checkpoint written before the position was recorded: AdamW's own step count stands in for it
    state = torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=True)
    for group in state["param_groups"]:
        del group[SCHEDULE_KEY]
    torch.save(state, tmp_path / "ckpt" / "optimizer.pt")
    resumed.load_optimizer(str(tmp_path / "ckpt"))
    assert resumed.steps_done == 2


def _grads(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_recomputes_layers_and_keeps_loss_and_gradients(tiny_model) -> None:
    batch, loss_fn = _batch(), make_loss_fn(LossSettings())
    plain = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.0, max_grad_norm=0.0)
    ckpt = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.0, max_grad_norm=0.0, gradient_checkpointing=True)
    calls = []
    # (a pre-hook: torch's recompute stops early, once the tensors backward needs are back)
    ckpt.model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    a, b = plain.train_step(batch, loss_fn, 1.0), ckpt.train_step(batch, loss_fn, 1.0)
    assert len(calls) == 2  # the layer ran again in backward: checkpointing is on (in eval mode too)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    ga, gb = _grads(plain), _grads(ckpt)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-5, atol=1e-7)
    assert not any(m.training for m in ckpt.model.modules() if not getattr(m, "gradient_checkpointing", False))
    calls.clear()
    ckpt.logprobs(batch, 1.0)  # no gradients: no recomputation
    assert len(calls) == 1


def test_the_fsdp_engine_applies_the_same_schedule_on_every_rank_and_resumes_it(tiny_model, tmp_path: Path) -> None:
    from asyncflow.engines.fsdp_train import FSDPTrainEngine

    schedule = LrSchedule(1e-2, kind="cosine", warmup_ratio=0.2, total_steps=10, min_lr_ratio=0.1, mini_batches=2)
    loss_fn = make_loss_fn(LossSettings())
    plain = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-2, mini_batches=2, schedule=schedule)
    fsdp = FSDPTrainEngine(copy.deepcopy(tiny_model), world_size=2, lr=1e-2, mini_batches=2, schedule=schedule,
                           gradient_checkpointing=True)
    try:
        for _ in range(2):
            got, want = fsdp.train_step(_batch(), loss_fn, 1.0), plain.train_step(_batch(), loss_fn, 1.0)
            assert got["lr"] == pytest.approx(want["lr"]) and got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        lrs = fsdp.call_ranks(_rank_lr, what="read the lr")
        assert lrs[0] == lrs[1] == pytest.approx(plain.optimizer.param_groups[0]["lr"])
        fsdp.save(str(tmp_path / "ckpt"), with_optimizer=True)
        resumed = FSDPTrainEngine(tmp_path / "ckpt", world_size=2, lr=1e-2, mini_batches=2, schedule=schedule)
        try:
            resumed.load_optimizer(str(tmp_path / "ckpt"))
            assert resumed.steps_done == 2
            assert resumed.train_step(_batch(), loss_fn, 1.0)["lr"] == pytest.approx(schedule.rates(2)[0] / 2
                                                                                      + schedule.rates(2)[1] / 2)
        finally:
            resumed.close()
    finally:
        fsdp.close()


def _rank_lr(rank) -> float:
    return float(rank.optimizer.param_groups[0]["lr"])


def test_schedule_keys_load_and_min_lr_ratio_needs_cosine() -> None:
    from asyncflow.config import load_config
    from asyncflow.engines.factory import lr_schedule

    cfg, _ = load_config(None, ["task=arith", "train.lr_schedule=cosine", "train.warmup_ratio=0.1",
                                "train.min_lr_ratio=0.2", "train.max_steps=5", "train.mini_batches=2",
                                "train.gradient_checkpointing=true"])
    s = lr_schedule(cfg)
    assert (s.kind, s.total_steps, s.warmup_steps, s.min_lr_ratio, s.lr) == ("cosine", 10, 1, 0.2, cfg.train.lr)
    assert cfg.train.gradient_checkpointing is True
    with pytest.raises(UserError, match=r"^train.min_lr_ratio: only used with train.lr_schedule=cosine"):
        load_config(None, ["task=arith", "train.min_lr_ratio=0.2"])
    with pytest.raises(UserError, match="train.lr_schedule"):
        load_config(None, ["task=arith", "train.lr_schedule=step"])


@pytest.mark.slow
def test_train_rows_log_the_scheduled_lr(arith_dir: Path, tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(None, ["task=arith",
        f"model.path={arith_dir}", "train.max_steps=3", "train.batch_size=8", "rollout.n=4",
        "rollout.max_new_tokens=4", "eval.size=8", "eval.every=0", "logging.progress=false",
        "train.lr=0.001", "train.lr_schedule=linear", "train.gradient_checkpointing=true",
    ])
    out = tmp_path / "run"
    train(cfg, out, progress_enabled=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r["kind"] == "train"] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])
