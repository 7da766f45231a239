"""The FSDP2 train engine on CPU (gloo, 2 worker processes) against the plain engine."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from asyncflow.algorithms.losses import LossSettings, make_loss_fn
from asyncflow.engines.fsdp_train import FSDPTrainEngine, make_shares
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.workflow.batch import build_train_batch


def test_rows_split_evenly_and_every_rank_runs_the_same_number_of_passes(train_batch) -> None:
    shares = make_shares(train_batch(5), 2, micro_batch_size=2)
    assert [len(s.rows) if s.rows is not None else 0 for s in shares] == [3, 2]
    assert [s.passes for s in shares] == [2, 2]  # rank 1 needs one pass, runs two (the second a dummy)
    shares = make_shares(train_batch(1), 2, micro_batch_size=None)
    assert shares[1].rows is None and shares[1].passes == 1


def test_ranks_get_equal_row_counts_with_balanced_token_counts() -> None:
    """Contiguous shares gave one rank the long rows (it set the pace of every collective); rows are
    dealt by length now, as many per rank as before, and the log-probs come back in the batch's order."""
    from asyncflow.transfer_queue import balance_equal_counts

    assert balance_equal_counts([10, 9, 1, 1], 2) == [[0, 3], [1, 2]]  # sums 11 and 10 (contiguous: 19 and 2)
    assert balance_equal_counts([5, 1, 1, 1, 1], 2) == [[0, 3, 4], [1, 2]]  # sizes stay 3 and 2, never 1 and 4
    assert balance_equal_counts([1], 3) == [[0], [], []]
    batch = build_train_batch([[3] * 9, [3] * 8, [3], [3]], [[4]] * 4, [[-1.0]] * 4, torch.zeros(4), [True] * 4, 0)
    shares = make_shares(batch, 2, micro_batch_size=None)
    assert [s.index for s in shares] == [[0, 3], [1, 2]]
    assert [int(s.rows.attention_mask.sum()) for s in shares if s.rows is not None] == [12, 11]


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        if k.endswith("k_proj.bias"):
            # attention is invariant to a key bias (it shifts every score of a query equally): its exact
            # gradient is 0, and Adam turns the float noise left in its place into full-size steps
            continue
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def test_every_architecture_s_blocks_are_sharded_one_by_one(tiny_model) -> None:
    """Only a ModuleList named `layers` was found: GPT-2, Bloom and Falcon keep their blocks in
    `transformer.h`, so only the root was sharded and the whole model was gathered at once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncflow.engines.fsdp_parts import decoder_layers

    assert decoder_layers(tiny_model) == list(tiny_model.model.layers)
    for kind, blocks, size in (("gpt2", "transformer.h", dict(n_layer=3, n_embd=32, n_head=2)),
                               ("bloom", "transformer.h", dict(n_layer=3, hidden_size=32, n_head=2)),
                               ("falcon", "transformer.h", dict(num_hidden_layers=3, hidden_size=32,
                                                                num_attention_heads=2))):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=64, **size))
        assert decoder_layers(model) == list(model.get_submodule(blocks)), kind


def test_fsdp_on_two_ranks_matches_the_plain_engine_and_round_trips_a_checkpoint(train_batch, tiny_model, tmp_path: Path) -> None:
    batch = train_batch(6)
    # 2 mini-batches of 3 rows: ranks get 2 and 1 rows; micro-batches of 1 make rank 1 run a dummy pass
    fsdp = FSDPTrainEngine(copy.deepcopy(tiny_model), world_size=2, lr=1e-2, mini_batches=2, micro_batch_size=1)
    try:
        plain = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-2, mini_batches=2)
        torch.testing.assert_close(fsdp.logprobs(batch, 0.7), plain.logprobs(batch, 0.7))
        _assert_same_weights(fsdp.export_weights(), plain.export_weights())
        for settings in (LossSettings(loss="ppo", agg="token_mean"),
                         LossSettings(loss="tis", agg="seq_mean_token_mean", is_level="sequence")):
            got = fsdp.train_step(batch, make_loss_fn(settings), 1.0)
            want = plain.train_step(batch, make_loss_fn(settings), 1.0)
            assert set(got) == set(want)
            for key in want:  # loss, entropy, grad_norm (the whole gradient's size), _max / _min metrics
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
            assert got["grad_norm"] > 0
            _assert_same_weights(fsdp.export_weights(), plain.export_weights())  # the same update direction
        # a checkpoint restores weights and optimizer state: a fresh engine then takes the same step
        fsdp.save(str(tmp_path / "ckpt"), with_optimizer=True)
        assert (tmp_path / "ckpt" / "optimizer.pt").is_file() and (tmp_path / "ckpt" / "config.json").is_file()
        (tmp_path / "ckpt" / "generation_config.json").write_text('{"max_length": 7}')
        resumed = FSDPTrainEngine(tmp_path / "ckpt", world_size=2, lr=1e-2, mini_batches=2, micro_batch_size=1)
        try:
            resumed.load_optimizer(str(tmp_path / "ckpt"))
            loss_fn = make_loss_fn(LossSettings())
            fsdp.train_step(batch, loss_fn, 1.0)
            resumed.train_step(batch, loss_fn, 1.0)
            _assert_same_weights(resumed.export_weights(), fsdp.export_weights())
            # the checkpoint it started from is pruned later (checkpoint.keep): its saves still work
            # (they re-read its config.json: a resumed run crashed at its next checkpoint)
            shutil.rmtree(tmp_path / "ckpt")
            resumed.save(str(tmp_path / "next"), with_optimizer=False)
            assert (tmp_path / "next" / "config.json").is_file()
            assert json.loads((tmp_path / "next" / "generation_config.json").read_text())["max_length"] == 7
        finally:
            resumed.close()
    finally:
        fsdp.close()


def test_an_engine_that_fails_to_start_leaves_no_temporary_model_folder(
        tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() is never reached for an engine whose start failed: the model folder it wrote for its
    workers (a whole model, in the temporary directory) stayed behind."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(Exception, match="start"):
        FSDPTrainEngine(copy.deepcopy(tiny_model), world_size=2, lr=1e-2, start_timeout_s=0.01)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("asyncflow-fsdp-")] == []


def test_a_dead_worker_is_an_error_naming_its_rank_not_a_hang(train_batch, tiny_model) -> None:
    engine = FSDPTrainEngine(copy.deepcopy(tiny_model), world_size=2, lr=1e-2, timeout_s=60)
    try:
        os.kill(engine._procs[1].pid, signal.SIGKILL)
        engine._procs[1].join(timeout=10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 died"):
            engine.logprobs(train_batch(4), 1.0)
        assert time.monotonic() - start < 30
        assert not engine._procs[0].is_alive()  # the survivor is stopped too (it would wait in a collective)
        with pytest.raises(RuntimeError, match="closed"):
            engine.logprobs(train_batch(4), 1.0)
    finally:
        engine.close()


@pytest.mark.slow
def test_short_training_run_with_the_fsdp_engine(arith_dir: Path, tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(None, ["task=arith",
        f"model.path={arith_dir}", "train.engine=fsdp", "train.world_size=2", "train.max_steps=2",
        "train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=4", "train.mini_batches=2",
        "eval.size=16", "eval.every=0", "logging.progress=false",
    ])
    out = tmp_path / "run"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 2 * 16
    # the ranks are spawned processes: transformers' progress bars are turned off in each of them too
    assert "Loading weights" not in capfd.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["loss"] == r["loss"] and r["grad_norm"] >= 0 for r in steps)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out / "final"))


def test_fsdp_bfloat16_trains_float32_master_weights_and_skips_non_finite_steps(train_batch, tiny_model, tmp_path: Path) -> None:
    """FSDP's mixed-precision policy: bf16 passes over float32 shards (bf16 shards lost most small
    AdamW updates); a NaN gradient leaves every rank's shard as it was."""
    fsdp = FSDPTrainEngine(copy.deepcopy(tiny_model), world_size=2, lr=1e-6, dtype=torch.bfloat16)
    try:
        batch = train_batch(4)
        before = fsdp.export_weights(master=True)
        assert {v.dtype for v in before.values()} == {torch.float32}

        def nan_loss(logp, mb, norm):
            return (logp * mb.response_mask).sum() * float("nan"), {}

        assert fsdp.train_step(batch, nan_loss, 1.0)["skipped_nonfinite"] == 1.0
        _assert_same_weights(fsdp.export_weights(master=True), before)
        metrics = fsdp.train_step(batch, make_loss_fn(LossSettings()), 1.0)
        assert metrics["skipped_nonfinite"] == 0.0
        after = fsdp.export_weights(master=True)
        weights = [k for k in after if k.endswith("weight")]
        assert all(not torch.equal(before[k], after[k]) for k in weights)  # a step of ~1e-6 lands on every weight
        assert {v.dtype for v in fsdp.export_weights().values()} == {torch.bfloat16}  # what rollout engines get
        fsdp.save(str(tmp_path / "ckpt"), with_optimizer=True)
        saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
        assert saved.get("dtype", saved.get("torch_dtype")) == "float32"
    finally:
        fsdp.close()
