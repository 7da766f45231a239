"""Delta weight sync (`runtime.weight_sync_delta`): the trainer publishes only the rollout-dtype
elements a step changed; engines apply them in place and prove the result by checksum, and load the
full weights of the version when they missed one or the checksum differs."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.config import LoraConfig
from asyncflow.engines.base import TrainBatch, changed_share, state_bytes
from asyncflow.engines.delta_train import DeltaTrainEngine
from asyncflow.engines.hf import HFEngine
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.engines.weight_delta import (
    DeltaEncoder,
    HeldWeights,
    ResyncNeeded,
    bits,
    state_checksum,
)

BF16 = torch.bfloat16


def _batch(n: int = 4, length: int = 8, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 32, (n, length), generator=g)
    mask = torch.zeros(n, length - 1)
    mask[:, 3:] = 1.0
    return TrainBatch(input_ids=ids, attention_mask=torch.ones(n, length, dtype=torch.long), response_mask=mask,
                      advantages=torch.tensor([1.0, -1.0] * (n // 2)), behavior_logprobs=torch.zeros(n, length - 1))


def _pg_loss(logp: torch.Tensor, mb: TrainBatch, norm: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -(logp * mb.response_mask * mb.advantages[:, None]).sum() / norm.tokens, {}


def _trainer(tiny_model: Any, lr: float = 1e-6, **kw: Any) -> DeltaTrainEngine:
    return DeltaTrainEngine(TorchTrainEngine(copy.deepcopy(tiny_model), lr=lr, dtype=BF16, **kw))


def _engine(tiny_model: Any) -> HFEngine:
    return HFEngine(copy.deepcopy(tiny_model).to(BF16), eos_token_id=1, max_batch=4, dtype=BF16)


def _load(engine: HFEngine, pub: Any, version: int) -> None:
    asyncio.run(engine.load_weights(pub, version, "swap"))


def _same_bits(engine: HFEngine, trainer: DeltaTrainEngine) -> bool:
    """The engine holds the trainer's rollout-dtype weights bit for bit."""
    want = trainer.inner.export_weights()
    own = engine.model.state_dict()
    return all(torch.equal(bits(own[k]), bits(v)) for k, v in want.items())


def test_delta_round_trip_equals_the_full_weights_bit_for_bit(tiny_model: Any) -> None:
    trainer, engine = _trainer(tiny_model), _engine(tiny_model)
    try:
        first = trainer.export_weights()
        assert not first.is_delta and changed_share(first) == 1.0  # (the full publication starting the stream)
        _load(engine, first, 0)
        assert _same_bits(engine, trainer)
        for version in range(1, 4):
            trainer.train_step(_batch(seed=version), _pg_loss, 1.0)
            pub = trainer.export_weights()
            assert pub.is_delta and 0 < pub.changed_elements < pub.total_elements
            assert state_bytes(pub) == pub.nbytes < state_bytes(first)  # (only what changed travels)
            assert changed_share(pub) == pub.changed_elements / pub.total_elements
            _load(engine, pub, version)
            assert _same_bits(engine, trainer)
            assert engine.held.checksum == pub.checksum == state_checksum(trainer.inner.export_weights())
        assert engine.counts["delta_loads"] == 3 and engine.counts["full_loads"] == 1
    finally:
        engine.shutdown()


def test_a_tensor_mostly_changed_goes_whole_and_an_unchanged_one_not_at_all() -> None:
    enc = DeltaEncoder()
    state = {"a": torch.zeros(100, dtype=BF16), "b": torch.zeros(100, dtype=BF16), "c": torch.ones(10, dtype=BF16)}
    enc.encode(state)
    state["a"][:90] = 1.0  # 90 changes: 90 x (2 + 4) bytes sparse > 200 bytes whole
    state["b"][3] = 2.0
    pub = enc.encode(state)
    assert pub.changes["a"].indices is None and pub.changes["b"].indices is not None
    assert pub.changes["b"].indices.tolist() == [3] and "c" not in pub.changes
    assert pub.nbytes == 200 + 2 + 4 and pub.changed_elements == 91
    assert pub.checksum == state_checksum(state)


def test_checksum_mismatch_loads_the_full_weights(tiny_model: Any) -> None:
    trainer, engine = _trainer(tiny_model), _engine(tiny_model)
    try:
        _load(engine, trainer.export_weights(), 0)
        trainer.train_step(_batch(seed=1), _pg_loss, 1.0)
        pub = trainer.export_weights()
        name = next(k for k, c in pub.changes.items() if c.indices is not None)
        # an element the delta writes holds something else on the engine than on the trainer
        with torch.no_grad():
            engine.model.state_dict()[name].view(-1)[int(pub.changes[name].indices[0])] += 1.0
        _load(engine, pub, 1)
        assert engine.counts["checksum_mismatches"] == 1 and engine.counts["full_loads"] == 2
        assert _same_bits(engine, trainer) and engine.version == 1
    finally:
        engine.shutdown()


def test_a_missed_version_loads_the_full_weights(tiny_model: Any) -> None:
    trainer, engine = _trainer(tiny_model), _engine(tiny_model)
    try:
        _load(engine, trainer.export_weights(), 0)
        for step in (1, 2):  # version 1 never reaches the engine
            trainer.train_step(_batch(seed=step), _pg_loss, 1.0)
            pub = trainer.export_weights()
        _load(engine, pub, 2)
        assert engine.counts.get("delta_loads", 0) == 0 and engine.counts["full_loads"] == 2
        assert _same_bits(engine, trainer)
    finally:
        engine.shutdown()


def test_a_delta_that_crossed_processes_asks_for_the_full_weights(tiny_model: Any) -> None:
    """Pickled, a publication carries its changes only: an engine it does not apply to refuses it
    before writing anything (`ResyncNeeded`), then takes the full copy of that version."""
    trainer, engine = _trainer(tiny_model), _engine(tiny_model)
    try:
        trainer.export_weights()  # (the engine missed the full first publication)
        trainer.train_step(_batch(seed=1), _pg_loss, 1.0)
        pub = trainer.export_weights()
        sent = pickle.loads(pickle.dumps(pub))
        assert sent.full is None and sent.changes.keys() == pub.changes.keys()
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        with pytest.raises(ResyncNeeded):
            _load(engine, sent, 1)
        assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
        full = trainer.published_full(pub.seq)
        assert full is not None and not full.is_delta and trainer.published_full(pub.seq - 1) is None
        _load(engine, pickle.loads(pickle.dumps(full)), 1)
        assert _same_bits(engine, trainer) and engine.held.checksum == pub.checksum
    finally:
        engine.shutdown()


def test_held_weights_refuse_a_delta_that_does_not_fit() -> None:
    held = HeldWeights()
    enc = DeltaEncoder()
    state = {"w": torch.zeros(8, dtype=BF16)}
    held.verify_full(enc.encode(state), {"w": state["w"].clone()})
    state["w"][1] = 1.0
    pub = enc.encode(state)
    assert held.applies(pub)
    with pytest.raises(Exception, match="does not fit"):
        held.write_delta(pub, {"v": torch.zeros(8, dtype=BF16)})


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (asyncflow[lora])")
def test_lora_adapter_deltas_merge_as_the_full_adapter_does(tiny_model: Any) -> None:
    lora = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    trainer = _trainer(tiny_model, lr=5e-2, lora=lora)
    by_delta, by_full = _engine(tiny_model), _engine(tiny_model)
    try:
        for version in range(3):
            if version:
                trainer.train_step(_batch(seed=version), _pg_loss, 1.0)
            pub = trainer.export_weights()
            assert pub.is_delta == (version > 0)
            _load(by_delta, pub, version)
            _load(by_full, {k: v.clone() for k, v in pub.full_state().items()}, version)
            assert by_delta.held.checksum == pub.checksum
            assert all(torch.equal(v, by_full.model.state_dict()[k]) for k, v in by_delta.model.state_dict().items())
        assert by_delta.counts["delta_loads"] == 2
    finally:
        by_delta.shutdown()
        by_full.shutdown()


def test_delta_sync_with_an_fsdp_trainer_is_refused_naming_the_key() -> None:
    from asyncflow.config import load_config
    from asyncflow.errors import UserError

    cfg, _ = load_config(None, ["task=arith", "runtime.weight_sync_delta=true"])
    assert cfg.runtime.weight_sync_delta is True
    with pytest.raises(UserError, match=r"^runtime\.weight_sync_delta: needs train\.engine=torch"):
        load_config(None, ["task=arith", "train.engine=fsdp", "runtime.weight_sync_delta=true"])


@pytest.mark.slow
def test_a_run_with_delta_sync_logs_the_share_of_elements_each_publication_changed(arith_dir: Path,
                                                                                   tmp_path: Path) -> None:
    import json

    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "runtime.weight_sync_delta=true",
                                "train.max_steps=3", "train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=4",
                                "eval.size=8", "eval.every=0", "logging.progress=false", "train.lr=0.01"])
    assert train(cfg, tmp_path / "run", progress_enabled=False)["accounting"]["lost"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shares = [r["weight_sync_changed_frac"] for r in rows if r["kind"] == "train"]
    # the first publication is full (it starts the stream); in float32 a step that moves the weights
    # changes nearly every element, one with no gradient (equal rewards in every group) none
    assert len(shares) == 3 and shares[0] == 1.0 and all(0.0 <= s <= 1.0 for s in shares), shares
