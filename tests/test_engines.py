"""The transformers engine (continuous batching, log-probs, weight-update modes) and the train engine."""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncflow.algorithms.losses import LossSettings, make_loss_fn
from asyncflow.engines.base import GenRequest, TrainBatch
from asyncflow.engines.hf import HFEngine
from asyncflow.engines.sampling import truncate_logits
from asyncflow.engines.torch_train import ReferenceModel, TorchTrainEngine
from asyncflow.workflow.batch import build_train_batch


def _requests(n: int, max_new: int = 10, temperature: float = 1.0, seed: int = 0) -> list[GenRequest]:
    g = torch.Generator().manual_seed(seed)
    return [
        GenRequest(i, torch.randint(2, 32, (2 + i % 6,), generator=g).tolist(), max_new, temperature) for i in range(n)
    ]


def _full_forward_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]


def test_continuous_batching_refills_slots_and_matches_full_forward_logprobs(tiny_model) -> None:
    engine = HFEngine(tiny_model, eos_token_id=1, max_batch=4, seed=1)
    try:
        reqs = _requests(23, temperature=0.7)
        results = engine.generate_many(reqs, timeout=60)
    finally:
        engine.shutdown()
    assert [r.uid for r in results] == list(range(23))
    # 23 requests through 4 slots: new ones joined while others were still decoding
    assert engine.steps < sum(len(r.response_ids) for r in results)
    worst = 0.0
    for req, res in zip(reqs, results, strict=True):
        assert 1 <= len(res.response_ids) <= req.max_new_tokens
        assert res.finish_reason == ("stop" if res.response_ids[-1] == 1 else "length")
        assert res.token_versions == [0] * len(res.response_ids)
        ref = _full_forward_logprobs(tiny_model, req.prompt_ids, res.response_ids, 0.7)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, res.behavior_logprobs, strict=True)))
    assert worst < 1e-4


def test_running_batch_never_exceeds_max_batch(tiny_model) -> None:
    engine = HFEngine(tiny_model, eos_token_id=1, max_batch=3)
    seen: list[int] = []
    original = engine._decode_step

    def spy() -> None:
        seen.append(len(engine._rows))
        original()

    engine._decode_step = spy  # type: ignore[method-assign]
    try:
        engine.generate_many(_requests(12), timeout=60)
    finally:
        engine.shutdown()
    assert seen and max(seen) <= 3


def test_greedy_requests_are_deterministic_and_argmax(tiny_model) -> None:
    engine = HFEngine(tiny_model, eos_token_id=1, max_batch=8)
    try:
        a = engine.generate_many(_requests(6, temperature=0.0), timeout=60)
        b = engine.generate_many(_requests(6, temperature=0.0), timeout=60)
    finally:
        engine.shutdown()
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    with torch.no_grad():
        req = _requests(1, temperature=0.0)[0]
        first = int(tiny_model(torch.tensor([req.prompt_ids])).logits[0, -1].argmax())
    assert a[0].response_ids[0] == first


def test_truncate_logits_keeps_top_k_and_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    out = truncate_logits(logits, [1.0, 0.7], [2, 0])
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # top-2
    assert torch.isfinite(out[1]).tolist() == [False, False, True, True]  # 0.5 + 0.3 >= 0.7
    probs = torch.softmax(out, -1)
    assert probs[0, :2].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])  # renormalised
    assert truncate_logits(logits, [1.0, 1.0], [0, 0]) is logits  # off: untouched
    assert torch.isfinite(truncate_logits(logits, [1e-6, 1e-6], [0, 0])).sum(-1).tolist() == [1, 1]  # top token kept


def test_top_k_one_samples_the_argmax_with_log_prob_zero(tiny_model) -> None:
    engine = HFEngine(tiny_model, eos_token_id=1, max_batch=8)
    try:
        reqs = [GenRequest(r.uid, r.prompt_ids, 6, 1.0, top_k=1) for r in _requests(4)]
        sampled = engine.generate_many(reqs, timeout=60)
        greedy = engine.generate_many(_requests(4, max_new=6, temperature=0.0), timeout=60)
    finally:
        engine.shutdown()
    assert [r.response_ids for r in sampled] == [r.response_ids for r in greedy]
    assert all(lp == pytest.approx(0.0, abs=1e-6) for r in sampled for lp in r.behavior_logprobs)


def _perturbed(model) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith("weight") and state[k].dim() == 2:
            state[k] += 0.5 * torch.randn_like(state[k])
    return state


def _slow_engine(model, **kw) -> HFEngine:
    engine = HFEngine(copy.deepcopy(model), eos_token_id=[], max_batch=16, **kw)
    original = engine._decode_step

    def slow() -> None:
        time.sleep(0.01)
        original()

    engine._decode_step = slow  # type: ignore[method-assign]
    return engine


@pytest.mark.parametrize("mode", ["swap", "drain", "abort"])
def test_weight_update_modes_keep_per_token_versions_right(tiny_model, mode: str) -> None:
    engine = _slow_engine(tiny_model)
    try:
        futures = [engine.submit(r) for r in _requests(4, max_new=30)]
        deadline = time.monotonic() + 30
        while engine.steps < 2 and time.monotonic() < deadline:  # a few tokens in (on a loaded machine too)
            time.sleep(0.01)
        loaded = engine.request_weights(_perturbed(tiny_model), 1, mode)  # type: ignore[arg-type]
        late = engine.submit(GenRequest(99, [3, 4, 5], 5, 1.0))
        results = [f.result(timeout=60) for f in futures]
        assert loaded.result(timeout=60) >= 0
        late_result = late.result(timeout=60)
    finally:
        engine.shutdown()
    for res in results:
        assert len(res.response_ids) == 30
        v = res.token_versions
        assert v == sorted(v) and v[0] == 0  # versions never go back; the first tokens are old
        if mode == "drain":
            assert set(v) == {0}  # in-flight requests finish on the old weights
        else:
            assert v[-1] == 1  # the rest of the request continued on the new weights
    assert set(late_result.token_versions) == {1}  # admitted after the load (drain: waited for it)
    assert engine.version == 1


def test_abort_mode_continues_with_tokens_so_far_and_new_weights(tiny_model) -> None:
    engine = _slow_engine(tiny_model)
    new_state = _perturbed(tiny_model)
    try:
        req = GenRequest(0, [5, 6, 7], 20, 1.0)
        fut = engine.submit(req)
        time.sleep(0.08)
        engine.request_weights(new_state, 1, "abort").result(timeout=60)
        res = fut.result(timeout=60)
    finally:
        engine.shutdown()
    k = res.token_versions.index(1)
    assert 0 < k < 20
    # tokens after the abort are scored by the new weights on the full context (prompt + tokens so far)
    new_model = copy.deepcopy(tiny_model)
    new_model.load_state_dict(new_state)
    ref = _full_forward_logprobs(new_model, req.prompt_ids, res.response_ids)
    assert max(abs(a - b) for a, b in zip(ref[k:], res.behavior_logprobs[k:], strict=True)) < 1e-4


def test_cancel_older_than_ends_stale_requests(tiny_model) -> None:
    """... but never an evaluation's (uid < 0): it was cut short and scored as the model's answer."""
    engine = _slow_engine(tiny_model)
    try:
        fut = engine.submit(GenRequest(0, [5, 6], 200, 1.0))
        evaluation = engine.submit(GenRequest(-1, [5, 6], 20, 0.0))
        time.sleep(0.05)
        assert engine.cancel_older_than(1) == 1
        res = fut.result(timeout=60)
        kept = evaluation.result(timeout=60)
    finally:
        engine.shutdown()
    assert res.finish_reason == "cancelled" and len(res.response_ids) < 200
    assert kept.finish_reason != "cancelled"


def test_engine_and_trainer_logprobs_agree_at_staleness_zero(tiny_model) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=1, max_batch=8, seed=3)
    try:
        reqs = _requests(16, max_new=8, temperature=0.9)
        results = engine.generate_many(reqs, timeout=60)
    finally:
        engine.shutdown()
    batch = build_train_batch(
        [r.prompt_ids for r in reqs], [r.response_ids for r in results], [r.behavior_logprobs for r in results],
        torch.zeros(16), [True] * 16, pad_token_id=0,
    )
    trainer = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-3)
    current = trainer.logprobs(batch, temperature=0.9)
    d = (current - batch.behavior_logprobs) * batch.response_mask
    mismatch_kl = float((torch.exp(d) - d - 1).sum() / batch.response_mask.sum())
    assert mismatch_kl < 1e-5
    # EOS is a trained action: a response that stopped has its EOS inside the loss mask
    stopped = [i for i, r in enumerate(results) if r.finish_reason == "stop"]
    assert stopped
    i = stopped[0]
    eos_pos = len(reqs[i].prompt_ids) - 1 + len(results[i].response_ids) - 1
    assert batch.input_ids[i, eos_pos + 1] == 1 and batch.response_mask[i, eos_pos] == 1


def _grads_after_step(model, batch, micro: int | None) -> dict[str, torch.Tensor]:
    trainer = TorchTrainEngine(copy.deepcopy(model), lr=0.0, micro_batch_size=micro, max_grad_norm=0.0)
    metrics = trainer.train_step(batch, make_loss_fn(LossSettings()), temperature=1.0)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    grads["__loss__"] = torch.tensor(metrics["loss"])
    return grads


def test_loss_and_gradients_do_not_depend_on_micro_batch_size(tiny_model) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 32, (3 + i % 3,), generator=g).tolist() for i in range(6)]
    responses = [torch.randint(2, 32, (1 + (i * 5) % 7,), generator=g).tolist() for i in range(6)]
    behavior = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    batch = build_train_batch(prompts, responses, behavior, torch.randn(6, generator=g), [True] * 6, 0)
    full = _grads_after_step(tiny_model, batch, None)
    for micro in (1, 4):
        part = _grads_after_step(tiny_model, batch, micro)
        for name, grad in full.items():
            torch.testing.assert_close(part[name], grad, rtol=1e-4, atol=1e-6)


def test_reference_model_runs_in_micro_batches_without_gradients_and_answers_on_the_cpu(tiny_model) -> None:
    """The KL reference's pass is micro-batched like the trainer's (a whole batch's logits at once
    would be batch x length x vocabulary floats) and gives the trainer's log-probs of the same weights."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 32, (2 + i % 4,), generator=g).tolist() for i in range(5)]
    responses = [torch.randint(2, 32, (1 + (i * 3) % 6,), generator=g).tolist() for i in range(5)]
    batch = build_train_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(5), [True] * 5, 0)
    ref = ReferenceModel(copy.deepcopy(tiny_model), temperature=0.8, micro_batch_size=2)
    rows: list[int] = []
    ref.model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    lp = ref(batch)
    assert rows == [2, 2, 1]
    assert lp.device.type == "cpu" and lp.shape == (5, batch.input_ids.shape[1] - 1)
    assert not any(p.requires_grad for p in ref.model.parameters())
    want = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.0).logprobs(batch, temperature=0.8)
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)


def test_train_step_changes_weights_and_export_is_a_copy(tiny_model) -> None:
    trainer = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-2, mini_batches=2)
    batch = build_train_batch([[3, 4], [5, 6]], [[7, 1], [8]], [[-1.0, -1.0], [-1.0]], torch.tensor([1.0, -1.0]), [True, True], 0)
    before = trainer.export_weights()
    metrics = trainer.train_step(batch, make_loss_fn(LossSettings()), 1.0)
    after = trainer.export_weights()
    assert {"loss", "grad_norm", "entropy", "clip_frac"} <= set(metrics)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    after[next(iter(after))].add_(1.0)  # mutating the export leaves the model alone
    assert not torch.equal(after[next(iter(after))], trainer.model.state_dict()[next(iter(after))])


def test_a_request_its_caller_abandons_ends_without_taking_the_engine_down(tiny_model) -> None:
    """A cancelled request future (its task timed out, or the rollout worker stopped) is dropped at
    the next retire: the decode thread used to die on `set_result` of the cancelled future, failing
    every later request. Both ways of asking are covered: `start_generate`'s future, and a task
    awaiting `generate`."""
    import asyncio

    engine = _slow_engine(tiny_model)

    async def main() -> tuple[int, int]:
        fut = engine.start_generate(GenRequest(0, [5, 6], 200, 1.0))
        task = asyncio.ensure_future(engine.generate(GenRequest(1, [5, 7], 200, 1.0)))
        await asyncio.sleep(0.1)
        fut.cancel()
        task.cancel()
        await asyncio.sleep(0.1)
        res = await asyncio.wait_for(engine.generate(GenRequest(2, [5, 8], 5, 1.0)), 60)
        # (a finished row is resolved a moment before the decode thread drops it from the batch)
        deadline = time.monotonic() + 1.0  # abandoned rows would decode ~2 s more, to 200 tokens
        while engine.load() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return len(res.response_ids), engine.load()

    try:
        n, load = asyncio.run(main())
        assert engine.error is None
    finally:
        engine.shutdown()
    assert n == 5  # the engine still serves requests
    assert load == 0  # and the abandoned ones left the batch instead of decoding to their cap


def test_a_weight_load_its_caller_abandons_leaves_the_engine_serving(tiny_model) -> None:
    """A publish that times out cancels its `load_weights`: the decode thread used to die on
    `set_result` of the cancelled future once the load happened, and a newer load superseding the
    abandoned one raised in its caller."""
    import asyncio

    engine = _slow_engine(tiny_model)
    state = _perturbed(tiny_model)

    async def main() -> tuple[str, int]:
        running = engine.start_generate(GenRequest(0, [5, 6], 30, 1.0))  # drain loads wait for it
        await asyncio.sleep(0.05)
        first = asyncio.ensure_future(engine.load_weights(state, 1, "drain"))
        await asyncio.sleep(0.02)
        first.cancel()
        await asyncio.sleep(0.02)
        await asyncio.wait_for(engine.load_weights(state, 2, "drain"), 60)  # supersedes the abandoned one
        await running
        res = await asyncio.wait_for(engine.generate(GenRequest(1, [5, 8], 5, 1.0)), 60)
        return res.finish_reason, engine.version

    try:
        reason, version = asyncio.run(main())
        assert engine.error is None
    finally:
        engine.shutdown()
    assert reason == "length" and version == 2


def test_a_drain_load_abandoned_while_it_waits_is_still_applied_without_killing_the_thread(tiny_model) -> None:
    import asyncio

    engine = _slow_engine(tiny_model)

    async def main() -> None:
        running = engine.start_generate(GenRequest(0, [5, 6], 30, 1.0))
        await asyncio.sleep(0.05)
        load = asyncio.ensure_future(engine.load_weights(_perturbed(tiny_model), 1, "drain"))
        await asyncio.sleep(0.02)
        load.cancel()
        await running
        for _ in range(100):  # the load lands once the running row has drained
            if engine.version == 1:
                break
            await asyncio.sleep(0.02)
        await asyncio.wait_for(engine.generate(GenRequest(1, [5, 8], 5, 1.0)), 60)

    try:
        asyncio.run(main())
        assert engine.error is None and engine.version == 1
    finally:
        engine.shutdown()


def test_engine_failure_reaches_the_caller_instead_of_hanging(tiny_model) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=1, max_batch=4)
    fut = engine.submit(GenRequest(0, [40, 41], 4, 1.0))  # token ids beyond the vocabulary
    with pytest.raises(IndexError):
        fut.result(timeout=30)
    with pytest.raises(RuntimeError, match="closed after an error"):
        engine.submit(GenRequest(1, [3], 4, 1.0))
    engine.shutdown()


def test_model_device_picks_a_gpu_only_where_the_process_sees_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """model.device (hf engines, torch trainer): auto is the CPU without a GPU, and spreads rollout
    engines over the GPUs there are; cuda without one is bad input, named by its key."""
    import torch

    from asyncflow.config import load_config
    from asyncflow.engines.base import pick_device
    from asyncflow.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == "cpu" and pick_device("cpu", 3) == "cpu"
    with pytest.raises(UserError, match=r"^model.device: cuda, but this process sees no GPU"):
        pick_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [pick_device("auto", i) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert pick_device("cuda") == "cuda:0" and pick_device("cpu") == "cpu"
    # on Ray an actor sees only the GPUs it was given: cuda without any is refused up front
    with pytest.raises(UserError, match=r"^model.device: cuda with runtime.kind=ray needs runtime.rollout_gpus"):
        load_config(None, ["task=arith", "runtime.kind=ray", "model.device=cuda", "runtime.rollout_gpus=1"])
    assert load_config(None, ["task=arith", "runtime.kind=ray", "model.device=cuda", "runtime.rollout_gpus=1",
                              "runtime.train_gpus=1"])[0].model.device == "cuda"


def test_a_batch_moves_to_a_device_whole_and_stays_put_where_it_is() -> None:
    """`TrainBatch.to`: every tensor field moves (None fields stay None); a batch already on the
    device is itself (no copies on the CPU path). The "meta" device stands in for a GPU here."""
    batch = build_train_batch([[3, 4], [5, 6]], [[7, 1], [8]], [[-1.0, -1.0], [-1.0]], torch.tensor([1.0, -1.0]), [True, True], 0)
    assert batch.to(torch.device("cpu")) is batch and batch.to("cpu") is batch
    moved = batch.to("meta")
    assert moved is not batch and moved.ref_logprobs is None and moved.proximal_logprobs is None
    tensors = [moved.input_ids, moved.attention_mask, moved.response_mask, moved.advantages, moved.behavior_logprobs]
    assert all(t.device.type == "meta" for t in tensors)
    assert moved.to("meta") is moved and batch.input_ids.device.type == "cpu"


def test_ray_actors_use_a_gpu_only_when_ray_gave_them_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray 2.x leaves CUDA_VISIBLE_DEVICES alone for an actor given no GPU, so `auto` must not take
    GPU 0 there (every such actor would load its model onto a GPU nobody reserved)."""
    from asyncflow.runtime.ray_runtime import actor_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert actor_device("auto", 0.0) == "cpu" and actor_device("auto", 0.5) == "cuda:0"
    assert actor_device("cpu", 1.0) == "cpu"


def _step_batch() -> TrainBatch:
    return build_train_batch([[3, 4], [5, 6]], [[7, 1], [8]], [[-1.0, -1.0], [-1.0]], torch.tensor([1.0, -1.0]),
                             [True, True], 0)


def test_bfloat16_training_keeps_float32_master_weights_so_small_updates_land(tiny_model, tmp_path: Path) -> None:
    """AdamW on bf16 weights rounded away most steps of ~lr (10 steps at lr 1e-6 changed 2% of the
    weights): the passes run on bf16 weights, the optimizer steps float32 masters of them, which a
    checkpoint saves; the exports and the final folder are bf16."""
    trainer = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-6, dtype=torch.bfloat16)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.stepped} == {torch.float32}
    masters = [m.detach().clone() for m in trainer.stepped]
    assert all(torch.equal(m, p.float()) for m, p in zip(masters, tiny_model.parameters(), strict=True))
    trainer.train_step(_step_batch(), make_loss_fn(LossSettings()), 1.0)
    assert all(not torch.equal(a, b) for a, b in zip(masters, trainer.stepped, strict=True))  # every update landed
    assert all(p.grad is None for p in trainer.model.parameters())  # (moved into the masters' float32 gradients)
    assert {v.dtype for v in trainer.export_weights().values()} == {torch.bfloat16}
    trainer.save(str(tmp_path / "ckpt"), with_optimizer=True)  # a checkpoint keeps the master weights
    trainer.save(str(tmp_path / "final"), with_optimizer=False)  # the final folder is in model.dtype
    ckpt = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=None)
    final = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=None)
    names = [k for k, _ in trainer.model.named_parameters()]
    i = next(j for j, k in enumerate(names) if k.endswith("q_proj.weight"))
    assert torch.equal(ckpt.state_dict()[names[i]], trainer.stepped[i].detach())
    assert final.state_dict()[names[i]].dtype == torch.bfloat16
    # each folder's config.json names its tensors' dtype (the final one said float32: loaded by default,
    # or by vLLM's dtype auto, at twice the memory)
    saved = {d: json.loads((tmp_path / d / "config.json").read_text())["dtype"] for d in ("ckpt", "final")}
    assert saved == {"ckpt": "float32", "final": "bfloat16"}
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "final")).dtype == torch.bfloat16
    resumed = TorchTrainEngine(str(tmp_path / "ckpt"), lr=1e-6, dtype=torch.bfloat16)  # exactly where it was
    assert all(torch.equal(a, b) for a, b in zip(resumed.stepped, trainer.stepped, strict=True))


def test_a_non_finite_gradient_skips_the_step_and_an_empty_mini_batch_takes_none(tiny_model) -> None:
    trainer = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-2)
    before = trainer.export_weights()

    def nan_loss(logp, mb, norm):
        return (logp * mb.response_mask).sum() * float("nan"), {}

    metrics = trainer.train_step(_step_batch(), nan_loss, 1.0)
    assert metrics["skipped_nonfinite"] == 1.0 and math.isnan(metrics["grad_norm"])
    after = trainer.export_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no NaN weight was made (or published)
    masked = _step_batch()
    masked.response_mask.zero_()  # every row masked out (e.g. reward errors)
    metrics = trainer.train_step(masked, make_loss_fn(LossSettings()), 1.0)
    assert metrics["grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in trainer.export_weights().items())  # AdamW did not move them
    metrics = trainer.train_step(_step_batch(), make_loss_fn(LossSettings()), 1.0)
    assert metrics["skipped_nonfinite"] == 0.0 and any(not torch.equal(before[k], v)
                                                       for k, v in trainer.export_weights().items())


def test_the_trainer_runs_without_dropout(tiny_model) -> None:
    """With dropout on, two log-prob passes of one batch differed and decoupled PPO's first ratio was not 1."""
    config = copy.deepcopy(tiny_model.config)
    config.attention_dropout = 0.5
    model = type(tiny_model)(config)
    model.load_state_dict(tiny_model.state_dict())
    trainer = TorchTrainEngine(model.train(), lr=0.0)
    batch = _step_batch()
    torch.testing.assert_close(trainer.logprobs(batch, 1.0), trainer.logprobs(batch, 1.0), rtol=0, atol=0)
    batch.proximal_logprobs = trainer.logprobs(batch, 1.0)
    metrics = trainer.train_step(batch, make_loss_fn(LossSettings(loss="decoupled_ppo")), 1.0)
    assert metrics["ratio_max"] == pytest.approx(1.0) and metrics["ratio_min"] == pytest.approx(1.0)


def test_an_encoder_model_is_refused_with_one_line_not_an_assertion_in_the_decode_loop() -> None:
    from transformers import BertConfig, BertLMHeadModel

    from asyncflow.errors import UserError

    config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    with pytest.raises(UserError, match=r"returned no KV cache: it is not a causal decoder"):
        HFEngine(BertLMHeadModel(config), eos_token_id=1)


def test_weights_that_diverge_end_the_run_with_one_line_in_the_trainer_and_in_the_engine(tiny_model) -> None:
    from asyncflow.errors import RunFailed

    trainer = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e30)  # one AdamW step of ~lr: weights of ~1e30
    with pytest.raises(RunFailed, match=r"^train.lr: the policy's weights diverged in an optimizer step"):
        trainer.train_step(_step_batch(), make_loss_fn(LossSettings()), 1.0)
    broken = copy.deepcopy(tiny_model)
    with torch.no_grad():
        next(broken.parameters()).fill_(float("nan"))
    engine = HFEngine(broken, eos_token_id=1)
    try:
        with pytest.raises(RunFailed, match=r"gives NaN or inf logits: its weights diverged"):
            engine.submit(_requests(1)[0]).result(timeout=60)
    finally:
        engine.shutdown()


def test_an_abort_load_then_cancel_older_than_ends_the_parked_requests(tiny_model) -> None:
    """An abort-mode load parks every running request in the queue; the pipeline calls
    cancel_older_than right after the load, when none is in the running batch: it used to cancel
    nothing, and stale requests ran to their end only to be dropped by the trainer."""
    engine = _slow_engine(tiny_model)
    try:
        futures = [engine.submit(GenRequest(i, [5, 6], 200, 1.0)) for i in range(3)]
        deadline = time.monotonic() + 30  # every request has old-weight tokens (a sleep was not enough on one core)
        while not (len(engine._rows) == 3 and all(r.versions for r in engine._rows)) and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.request_weights(_perturbed(tiny_model), 1, "abort").result(timeout=60)
        assert engine.cancel_older_than(1) == 3
        results = [f.result(timeout=60) for f in futures]
    finally:
        engine.shutdown()
    assert all(r.finish_reason == "cancelled" and len(r.response_ids) < 200 for r in results)
    # started under the old weights (on one core the engine may decode a step under the new ones
    # between the load's end and the call: the pipeline also cancels before the load)
    assert all(r.token_versions[0] == 0 for r in results)


def test_weights_that_do_not_fit_are_refused_and_the_engine_keeps_serving(tiny_model) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=1)
    try:
        state = _perturbed(tiny_model)
        state["extra.weight"] = torch.zeros(1)
        with pytest.raises(ValueError, match=r"version 1's weights do not fit the model: unexpected \['extra.weight'\]"):
            engine.request_weights(state, 1, "swap").result(timeout=60)
        assert engine.version == 0 and engine.error is None
        for name, value in engine.model.state_dict().items():  # nothing was copied before the refusal
            torch.testing.assert_close(value, tiny_model.state_dict()[name], rtol=0, atol=0)
        assert engine.submit(_requests(1)[0]).result(timeout=60).finish_reason in ("stop", "length")
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match=r"engine rollout is closed \(shut down\); cannot load version 2"):
        engine.request_weights(_perturbed(tiny_model), 2, "swap").result(timeout=10)  # at once, not at a timeout


def test_a_sliding_window_model_decodes_rows_of_different_lengths_together(tiny_model) -> None:
    """Its own cache keeps only the window per layer, which fell out of step with the engine's mask
    once rows of different lengths shared the batch (every request then failed)."""
    config = copy.deepcopy(tiny_model.config)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = type(tiny_model)(config).eval()
    model.load_state_dict(tiny_model.state_dict())
    engine = HFEngine(model, eos_token_id=[], max_batch=4, seed=1)
    requests = [GenRequest(0, list(range(2, 22)), 2, 0.7), GenRequest(1, [5, 6, 7], 12, 0.7)]
    try:
        results = engine.generate_many(requests, timeout=60)
    finally:
        engine.shutdown()
    for req, res in zip(requests, results, strict=True):
        ref = _full_forward_logprobs(model, req.prompt_ids, res.response_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(ref, res.behavior_logprobs, strict=True)) < 1e-4


def test_prefill_asks_for_last_position_logits_only_and_bf16_keeps_the_exact_temperature(tiny_model) -> None:
    import concurrent.futures as cf

    from asyncflow.engines.hf import _Row

    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=1)
    shapes: list[tuple[int, ...]] = []
    engine.model.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.logits.shape)))
    try:
        engine.generate_many([GenRequest(0, list(range(2, 30)), 1, 1.0)], timeout=60)
    finally:
        engine.shutdown()
    assert shapes[0] == (1, 1, 32)  # not (1, 28, 32): a batch of long prompts made [rows, width, vocabulary]
    logits = (torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    rows = [_Row(GenRequest(i, [2], 8, 0.7), cf.Future()) for i in range(4)]
    engine._sample_into(rows, logits)
    for row, lg in zip(rows, logits, strict=True):  # the trainer divides by 0.7, not by bf16's 0.69921875
        assert row.logprobs[0] == pytest.approx(float(torch.log_softmax(lg.float() / 0.7, -1)[row.tokens[0]]), abs=1e-6)


def test_top_k_comes_before_the_nucleus_as_in_transformers_and_vllm() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    kept = truncate_logits(logits, [0.5], [2]).isfinite()[0].tolist()
    assert kept == [True, False, False, False]  # of top-2 renormalised (0.57, 0.43), 0.57 reaches p=0.5
