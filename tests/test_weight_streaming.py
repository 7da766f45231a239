"""Weights move with no second copy of the state: a broadcast is received straight into an engine's
parameters (one reused bucket of extra memory), the object store carries raw bytes once, a weight
folder is written tensor by tensor and read as a memory map, and a tied weight travels once."""

from __future__ import annotations

import copy
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncflow.engines.weight_sync as ws
from asyncflow.engines.base import GenRequest, state_bytes
from asyncflow.engines.hf import HFEngine
from asyncflow.engines.safetensors_io import map_file, write_file
from asyncflow.engines.shared_state import SharedState
from asyncflow.engines.weight_sync import (
    BroadcastWeightReceiver,
    BroadcastWeightSender,
    WeightsRefused,
    aliases,
)

BUCKET = 4096


def _record_sends(monkeypatch: pytest.MonkeyPatch, state: dict[str, torch.Tensor], version: int,
                  direct_bytes: int = ws.DEFAULT_DIRECT_BYTES) -> list[torch.Tensor]:
    """What a sender broadcasts for `state` (each collective's tensor, cloned)."""
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(ws, "_bcast", lambda t, *a: sent.append(t.clone()))
    BroadcastWeightSender(bucket_bytes=BUCKET, direct_bytes=direct_bytes).send(state, version)
    return sent


def _replay(monkeypatch: pytest.MonkeyPatch, sent: list[torch.Tensor], seen: list[torch.Tensor]) -> None:
    """Make every receive take the next recorded broadcast (and note the tensor it was received into)."""
    feed = iter(sent)

    def receive(t: torch.Tensor, *a: Any) -> None:
        seen.append(t)
        t.copy_(next(feed))

    monkeypatch.setattr(ws, "_bcast", receive)


def _tied_model(tiny_model: Any) -> Any:
    model = copy.deepcopy(tiny_model)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("direct_bytes", [ws.DEFAULT_DIRECT_BYTES, 1024])
def test_a_broadcast_is_received_in_place_with_one_bucket_of_extra_memory(monkeypatch: pytest.MonkeyPatch,
                                                                          tiny_model: Any, direct_bytes: int) -> None:
    """Small tensors come packed in buckets (one reused buffer), large ones by themselves straight
    into the parameter's memory (`direct_bytes`: 1,024 sends most of the tiny model's that way)."""
    sender = _tied_model(tiny_model)
    with torch.no_grad():
        for p in sender.parameters():
            p.add_(1.0)
    receiver = _tied_model(tiny_model)
    params = receiver.state_dict()
    before = {k: v.data_ptr() for k, v in params.items()}
    sent = _record_sends(monkeypatch, sender.state_dict(), 5, direct_bytes)
    assert len(sent) > 4  # (several buckets)
    seen: list[torch.Tensor] = []
    _replay(monkeypatch, sent, seen)
    monkeypatch.setattr(ws, "allocate", lambda *a: pytest.fail("a whole state was allocated"))
    assert BroadcastWeightReceiver().receive_into(params, 60.0, expect=5) == 5
    after = receiver.state_dict()
    assert {k: v.data_ptr() for k, v in after.items()} == before  # loaded in place
    for k, v in sender.state_dict().items():
        assert torch.equal(after[k], v), k
    own = {p.untyped_storage().data_ptr() for p in receiver.parameters()}
    transfers = seen[2:]  # (after the header and the metadata)
    buckets = [t for t in transfers if t.untyped_storage().data_ptr() not in own]
    direct = len(transfers) - len(buckets)
    assert (direct > 0) == (direct_bytes == 1024)
    assert len({t.untyped_storage().data_ptr() for t in buckets}) == 1  # one buffer, reused
    assert max(t.untyped_storage().nbytes() for t in buckets) <= BUCKET


def test_the_tied_weight_is_broadcast_once(monkeypatch: pytest.MonkeyPatch, tiny_model: Any) -> None:
    model = _tied_model(tiny_model)
    state = model.state_dict()
    assert aliases(state) == {"lm_head.weight": "model.embed_tokens.weight"}
    sent = _record_sends(monkeypatch, state, 1)
    assert sum(t.numel() for t in sent[2:]) == state_bytes(state)
    _replay(monkeypatch, sent, [])
    got, version = BroadcastWeightReceiver().receive(60.0)
    assert version == 1 and set(got) == set(state)
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]


def test_a_refused_broadcast_is_still_received_whole_and_leaves_the_weights(monkeypatch: pytest.MonkeyPatch,
                                                                            tiny_model: Any) -> None:
    state = {k: v + 1 for k, v in tiny_model.state_dict().items()}
    params = copy.deepcopy(tiny_model).state_dict()
    old = {k: v.clone() for k, v in params.items()}
    sent = _record_sends(monkeypatch, state, 4)
    seen: list[torch.Tensor] = []
    _replay(monkeypatch, sent, seen)
    with pytest.raises(WeightsRefused, match="version 4 arrived where 3"):
        BroadcastWeightReceiver().receive_into(params, 60.0, expect=3)
    assert len(seen) == len(sent)  # every bucket taken: the group stays in step
    assert all(torch.equal(params[k], old[k]) for k in params)


def test_an_engine_fills_its_parameters_in_place_at_the_load_point(tiny_model: Any) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=1, max_batch=4)
    try:
        ptrs = [p.data_ptr() for p in engine.model.parameters()]
        new = {k: v + 1 for k, v in tiny_model.state_dict().items()}

        def fill(params: dict[str, torch.Tensor]) -> None:
            for k, v in params.items():
                v.copy_(new[k])

        engine.request_fill(fill, 3, "drain").result(timeout=60)
        assert engine.version == 3
        assert [p.data_ptr() for p in engine.model.parameters()] == ptrs
        assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in new.items())

        def refuse(params: dict[str, torch.Tensor]) -> None:
            raise WeightsRefused("not this one")

        with pytest.raises(WeightsRefused):
            engine.request_fill(refuse, 4, "swap").result(timeout=60)
        assert engine.version == 3
        assert engine.generate_many([GenRequest(0, [5, 6], 3, 1.0)], timeout=60)[0].token_versions == [3, 3, 3]
    finally:
        engine.shutdown()


def test_a_fill_cancelled_before_it_began_is_skipped(tiny_model: Any) -> None:
    """(Its caller gave up, e.g. the trainer's send failed: a receive would wait for bytes that never come.)"""
    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=[], max_batch=4)  # (no EOS: it runs on)
    try:
        engine.submit(GenRequest(0, [5, 6], 2000, 1.0))  # running: a drain fill waits for it
        deadline = time.monotonic() + 60
        while engine.steps == 0 and time.monotonic() < deadline:  # (decoding, not just queued)
            time.sleep(0.01)
        ran: list[int] = []
        first = engine.request_fill(lambda params: ran.append(1), 1, "drain")
        assert first.cancel()
        engine.request_fill(lambda params: ran.append(2), 2, "abort").result(timeout=60)
        assert ran == [2] and engine.version == 2
    finally:
        engine.shutdown()


def test_an_engine_whose_fill_failed_midway_decodes_again_only_after_a_whole_load(tiny_model: Any) -> None:
    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=1, max_batch=4)
    try:
        def broken(params: dict[str, torch.Tensor]) -> None:
            next(iter(params.values())).zero_()
            raise RuntimeError("the trainer went away")

        with pytest.raises(RuntimeError, match="went away"):
            engine.request_fill(broken, 2, "swap").result(timeout=60)
        request = engine.submit(GenRequest(0, [5, 6], 2, 1.0))
        with pytest.raises(TimeoutError):
            request.result(timeout=0.5)  # (held: the weights are mixed)
        engine.request_weights(tiny_model.state_dict(), 2, "swap").result(timeout=60)
        assert request.result(timeout=60).token_versions == [2, 2]
    finally:
        engine.shutdown()


def test_shared_state_pickles_each_tensor_once_out_of_band(tiny_model: Any) -> None:
    state = _tied_model(tiny_model).to(torch.bfloat16).state_dict()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(SharedState(state), protocol=5, buffer_callback=buffers.append)
    assert len(data) < 10_000  # the bytes are not in the pickle stream
    assert sum(memoryview(b).nbytes for b in buffers) == state_bytes(state)
    got = pickle.loads(data, buffers=buffers)
    assert list(got) == list(state) and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in state.items())
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()


def test_a_weight_folder_is_written_and_mapped_in_safetensors_format(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = {"a": torch.randn(3, 5).to(torch.bfloat16), "ids": torch.arange(7), "s": torch.tensor(2.5),
             "empty": torch.zeros(0, 3), "t": torch.randn(4, 6).t(), "mask": torch.rand(5) > 0.5}
    write_file(state, tmp_path / "ours.safetensors", metadata={"format": "pt"})
    theirs = load_file(str(tmp_path / "ours.safetensors"))
    assert all(torch.equal(theirs[k], v) for k, v in state.items())
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "theirs.safetensors"))
    for name in ("ours", "theirs"):
        mapped = map_file(tmp_path / f"{name}.safetensors")
        assert all(torch.equal(mapped[k], v) and mapped[k].dtype == v.dtype for k, v in state.items())
    mapped = map_file(tmp_path / "ours.safetensors")
    storages = {t.untyped_storage().data_ptr() for k, t in mapped.items() if t.numel()}
    assert len(storages) == 1  # views of one map, not copies


def test_a_trainer_exports_a_tied_weight_once(tiny_model: Any) -> None:
    from asyncflow.engines.torch_train import TorchTrainEngine

    trainer = TorchTrainEngine(_tied_model(tiny_model), lr=1e-3, dtype=torch.bfloat16)
    state = trainer.export_weights()
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    unique = {p.data_ptr(): p.numel() for p in trainer.model.parameters()}
    assert trainer.export_bytes() == 2 * sum(unique.values())


def test_a_trainer_that_reuses_export_memory_overwrites_the_last_export_in_place(tiny_model: Any,
                                                                                 tmp_path: Path) -> None:
    from asyncflow.engines.torch_train import TorchTrainEngine

    fresh = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-3, dtype=torch.bfloat16)
    a, b = fresh.export_weights(), fresh.export_weights()
    assert all(a[k].data_ptr() != b[k].data_ptr() for k in a)  # the default: a new tensor per export

    trainer = TorchTrainEngine(copy.deepcopy(tiny_model), lr=1e-3, dtype=torch.bfloat16)
    trainer.reuse_export_memory()
    first = trainer.export_weights()
    ptrs = {k: t.data_ptr() for k, t in first.items()}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)
    second = trainer.export_weights()
    assert {k: t.data_ptr() for k, t in second.items()} == ptrs  # the same memory, new values
    for k, p in trainer.model.state_dict().items():
        assert second[k].dtype == torch.bfloat16 and torch.equal(second[k], p.to(torch.bfloat16)), k
    kept = {k: t.clone() for k, t in second.items()}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)
    trainer.save(str(tmp_path / "final"), with_optimizer=False)  # a save's export is a copy of its own
    assert all(torch.equal(second[k], kept[k]) for k in kept)
