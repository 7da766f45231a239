"""Delta publications on every transport: Ray's object store (`SharedState`), the collective
broadcast (`WeightPort`, each collective recorded and replayed), and weight folders for
`asyncflow serve` (the openai engine against a served model). After every publication the engine
holds the trainer's rollout-dtype weights bit for bit."""

from __future__ import annotations

import asyncio
import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.engines import weight_sync as ws
from asyncflow.engines.base import TrainBatch
from asyncflow.engines.delta_train import DeltaTrainEngine
from asyncflow.engines.hf import HFEngine
from asyncflow.engines.shared_state import SharedState
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.engines.weight_delta import Publication, ResyncNeeded, bits
from asyncflow.runtime.ray_weights import WeightPort

BF16 = torch.bfloat16


def _step(trainer: DeltaTrainEngine, seed: int) -> Publication:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 30, (4, 8), generator=g)
    mask = torch.zeros(4, 7)
    mask[:, 3:] = 1.0
    batch = TrainBatch(ids, torch.ones_like(ids), mask, torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.zeros(4, 7))
    trainer.train_step(batch, lambda logp, mb, norm: (-(logp * mb.response_mask * mb.advantages[:, None]).sum()
                                                      / norm.tokens, {}), 1.0)
    return trainer.export_weights()


def _same_bits(model: Any, trainer: DeltaTrainEngine) -> bool:
    own = model.state_dict()
    return all(torch.equal(bits(own[k].to(v.dtype)), bits(v)) for k, v in trainer.inner.export_weights().items())


def test_a_delta_through_the_object_store_moves_only_its_changes(tiny_model: Any) -> None:
    trainer = DeltaTrainEngine(TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-6, dtype=BF16))
    engine = HFEngine(copy.deepcopy(tiny_model).to(BF16), eos_token_id=1, max_batch=4, dtype=BF16)
    try:
        for version in range(3):
            pub = trainer.export_weights() if version == 0 else _step(trainer, version)
            buffers: list[pickle.PickleBuffer] = []
            data = pickle.dumps(SharedState(pub), protocol=5, buffer_callback=buffers.append)
            assert sum(memoryview(b).nbytes for b in buffers) == pub.nbytes  # (out of band, once)
            got = pickle.loads(data, buffers=buffers)
            assert isinstance(got, Publication) and got.full is None and got.is_delta == (version > 0)
            asyncio.run(engine.load_weights(got, version, "swap"))
            assert _same_bits(engine.model, trainer)
        assert engine.counts["delta_loads"] == 2
    finally:
        engine.shutdown()


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(ws, "_bcast", lambda t, *a: sent.append(t.clone()))
    return sent


def _replayed(monkeypatch: pytest.MonkeyPatch, sent: list[torch.Tensor]) -> None:
    feed = iter(sent)
    monkeypatch.setattr(ws, "_bcast", lambda t, *a: t.copy_(next(feed)))


def _port() -> WeightPort:
    port = WeightPort(4096, 30.0)
    port.group = ws.WeightGroup(pg=None, rank=0, size=2, device=torch.device("cpu"))
    return port


def test_a_delta_broadcast_is_written_into_the_engine_and_a_missed_one_is_refused(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Any) -> None:
    """Received in place (`request_fill`, as a rollout actor does) a delta updates the engine; one
    that does not apply (the engine missed a version) is refused before any write, and the trainer's
    port keeps that version's full weights for the object-store fallback."""
    trainer = DeltaTrainEngine(TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-6, dtype=BF16))
    engine = HFEngine(copy.deepcopy(tiny_model).to(BF16), eos_token_id=1, max_batch=4, dtype=BF16)
    sender, receiver = _port(), _port()

    def broadcast(pub: Publication, version: int) -> None:
        sent = _recorded(monkeypatch)
        sender.send(pub, version)
        _replayed(monkeypatch, sent)
        incoming = receiver.announced(version)
        engine.request_fill(lambda params: receiver.receive_into(params, version, incoming), version,
                            "swap").result(timeout=30)

    try:
        broadcast(trainer.export_weights(), 0)  # (full: straight into the parameters, checksum proven)
        assert engine.held.checksum is not None
        broadcast(_step(trainer, 1), 1)
        assert _same_bits(engine.model, trainer) and engine.version == 1
        _step(trainer, 2)  # version 2 never reaches the engine
        receiver.group = sender.group
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        with pytest.raises(ResyncNeeded):
            broadcast(_step(trainer, 3), 3)
        assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
        full = sender.published(3)
        assert isinstance(full, Publication) and not full.is_delta
        asyncio.run(engine.load_weights(pickle.loads(pickle.dumps(SharedState(full))), 3, "swap"))
        assert _same_bits(engine.model, trainer) and engine.version == 3
    finally:
        engine.shutdown()


def test_asyncflow_serve_applies_delta_folders_and_asks_for_the_full_weights_after_a_missed_one(
        tmp_path: Path) -> None:
    from asyncflow.engines.openai_engine import OpenAIEngine
    from asyncflow.engines.server_sync import AsyncflowSync, WeightFolderWriter
    from asyncflow.serve_main import make_app, start_http
    from asyncflow.tasks.arith import make_model, make_tokenizer

    tok = make_tokenizer()
    base_dir = tmp_path / "base"
    base = make_model(tok, seed=0, hidden=64)
    base.save_pretrained(str(base_dir))
    tok.save_pretrained(str(base_dir))
    trainer = DeltaTrainEngine(TorchTrainEngine(copy.deepcopy(base), lr=1e-6, dtype=BF16))
    app = make_app(base_dir, model_name="tiny", token=None, max_batch=8)
    http, _ = start_http(app, "127.0.0.1", 0)
    engine = OpenAIEngine(f"http://127.0.0.1:{http.server_address[1]}", sync=AsyncflowSync(),
                          writer=WeightFolderWriter(tmp_path / "sync", base_dir, in_place=False),
                          server_type="asyncflow", request_timeout_s=60, sync_timeout_s=60)

    async def scenario() -> list[int]:
        await engine.connect(None)
        sizes = []
        for version in range(4):
            pub = trainer.export_weights() if version == 0 else _step(trainer, version)
            if version != 2:  # version 2 never reaches the server
                await engine.load_weights(pub, version, "drain")
                sizes.append(sum(f.stat().st_size for f in (tmp_path / "sync" / f"d{version:06d}").glob("*"))
                             if pub.is_delta else 0)
        return sizes

    try:
        sizes = asyncio.run(scenario())
        served = app.engine
        assert served.version == 3 and _same_bits(served.model, trainer)
        # v0 full, v1 a delta folder, v3 a delta refused with 409, then its full folder
        assert served.counts["delta_loads"] == 1 and served.counts["full_loads"] == 2
        assert (tmp_path / "sync" / "v000003" / "publication.json").is_file()
        assert 0 < sizes[1] < (tmp_path / "sync" / "v000003" / "model.safetensors").stat().st_size / 4
    finally:
        http.shutdown()
        http.server_close()
        app.engine.shutdown()


class _RemoteEngine:
    """A rollout actor as the driver sees it (`RemoteEngine`): its `load_weights` refuses a delta as
    the actor's engine does (`ResyncNeeded`, wrapped by Ray) and loads anything else."""

    def __init__(self) -> None:
        self.handle, self.loaded = self, []
        self.load_weights = self

    def remote(self, state: Any, version: int, mode: str) -> Any:
        return state, version

    async def unless_down(self, call: Any, what: str) -> Any:
        import ray

        state, version = call
        if state == "delta":
            raise ray.exceptions.RayTaskError("load_weights", "", ResyncNeeded("the delta does not apply", 7))
        self.loaded.append((state, version))
        return {"seconds": 0.0}


def test_the_driver_has_an_actor_that_refused_a_delta_load_that_publications_full_weights() -> None:
    from asyncflow.runtime.ray_weights import StoredWeights

    engine = _RemoteEngine()
    asked: list[int | None] = []
    stored = StoredWeights("delta", resync=lambda seq: asked.append(seq) or f"full of {seq}")
    assert asyncio.run(stored.deliver(engine, 3, "swap")) == {"seconds": 0.0}
    assert asked == [7] and engine.loaded == [("full of 7", 3)]
    assert stored.catch_up() == "full of None"  # (a restarted actor: the last publication's full weights)
    assert pickle.loads(pickle.dumps(ResyncNeeded("why", 7))).seq == 7
