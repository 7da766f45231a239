"""LoRA (`model.lora`): the trainer trains only a PEFT adapter, publishes only the adapter, takes its
KL reference with the adapter off; engines that receive it generate as the merged model does."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.config import LoraConfig, load_config
from asyncflow.engines import lora
from asyncflow.engines.base import GenRequest, TrainBatch, state_bytes
from asyncflow.engines.hf import HFEngine
from asyncflow.engines.torch_train import TorchTrainEngine, token_logprobs
from asyncflow.errors import UserError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (asyncflow[lora])")

SETTINGS = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


def _batch(n: int = 4, length: int = 8, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 32, (n, length), generator=g)
    mask = torch.zeros(n, length - 1)
    mask[:, 3:] = 1.0
    return TrainBatch(input_ids=ids, attention_mask=torch.ones(n, length, dtype=torch.long), response_mask=mask,
                      advantages=torch.tensor([1.0, -1.0] * (n // 2)), behavior_logprobs=torch.zeros(n, length - 1))


def _pg_loss(logp: torch.Tensor, mb: TrainBatch, norm: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = -(logp * mb.response_mask * mb.advantages[:, None]).sum() / norm.tokens
    return loss, {}


def _trained(tiny_model: Any, steps: int = 3) -> TorchTrainEngine:
    engine = TorchTrainEngine(copy.deepcopy(tiny_model), lr=5e-2, lora=SETTINGS)
    for _ in range(steps):
        engine.train_step(_batch(), _pg_loss, 1.0)
    return engine


def test_config_section_is_null_by_default_and_refused_without_peft(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _ = load_config(None, ["task=arith"])
    assert cfg.model.lora is None
    cfg, _ = load_config(None, ["task=arith", "model.lora.r=8", "model.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.model.lora == LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(UserError, match=r"model\.lora\.rank: unknown key"):
        load_config(None, ["task=arith", "model.lora.rank=8"])
    with pytest.raises(UserError, match=r"model\.lora\.r: 0 is below"):
        load_config(None, ["task=arith", "model.lora.r=0"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(UserError, match=r"^model\.lora: the peft package is not installed"):
        load_config(None, ["task=arith", "model.lora.r=8"])


def test_only_the_adapter_trains_and_is_published(tiny_model: Any) -> None:
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    engine = _trained(tiny_model)
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == len(trainable)
    base = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
            for k, v in engine.model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base[k], v) for k, v in before.items())  # the base weights never moved
    state = engine.export_weights()
    assert lora.is_adapter(state)
    adapter_bytes = sum(engine.model.get_parameter(n).numel() * 4 for n in trainable)
    full_bytes = sum(v.numel() * v.element_size() for v in tiny_model.state_dict().values())
    moved = state_bytes(state)
    assert moved is not None and adapter_bytes <= moved < adapter_bytes + 4096  # (+ the marker's JSON)
    assert moved < full_bytes / 5


def test_reference_is_the_base_model_with_the_adapter_off(tiny_model: Any) -> None:
    engine = _trained(tiny_model)
    batch = _batch(seed=1)
    with torch.no_grad():
        base = token_logprobs(tiny_model, batch, 1.0)[0]
    ref = engine.reference_logprobs(batch, 1.0)
    policy = engine.logprobs(batch, 1.0)
    assert torch.allclose(ref, base, atol=1e-5)
    assert not torch.allclose(policy, base, atol=1e-3)  # the adapter is on again after the reference pass


def _greedy(engine: HFEngine) -> list[list[int]]:
    reqs = [GenRequest(i, [5 + i, 6, 7, 9 + i], 8, 0.0) for i in range(4)]
    return [r.response_ids for r in engine.generate_many(reqs, timeout=60)]


def test_hf_engine_merges_each_version_onto_the_base(tiny_model: Any) -> None:
    trainer = _trained(tiny_model)
    first = trainer.export_weights()
    for _ in range(3):
        trainer.train_step(_batch(seed=2), _pg_loss, 1.0)
    second = trainer.export_weights()
    merged = copy.deepcopy(trainer.model).merge_and_unload().eval()
    reference = HFEngine(merged, eos_token_id=1, max_batch=8)
    engine = HFEngine(copy.deepcopy(tiny_model), eos_token_id=1, max_batch=8)
    try:
        for version, state in ((1, first), (2, second)):
            asyncio.run(engine.load_weights(state, version, "drain"))
        assert engine.version == 2
        for name, delta in lora.deltas(second).items():  # onto the base, not base + first + second
            expected = tiny_model.get_parameter(name) + delta
            assert torch.allclose(engine.model.get_parameter(name), expected, atol=1e-6), name
        assert _greedy(engine) == _greedy(reference)
    finally:
        engine.shutdown()
        reference.shutdown()


def test_asyncflow_serve_loads_a_peft_adapter_folder(tiny_model: Any, tmp_path: Path) -> None:
    """The openai engine against `asyncflow serve`: the adapter is written in PEFT layout, loaded
    through /admin/load_weights and merged; greedy replies equal the merged model's."""
    from transformers import AutoTokenizer  # noqa: F401  (serve needs a tokenizer folder: the arith one)

    from asyncflow.engines.openai_engine import OpenAIEngine
    from asyncflow.engines.server_sync import AsyncflowSync, WeightFolderWriter
    from asyncflow.serve_main import make_app, start_http
    from asyncflow.tasks.arith import make_model, make_tokenizer

    tok = make_tokenizer()
    base_dir = tmp_path / "base"
    base = make_model(tok, seed=0, hidden=64)
    base.save_pretrained(str(base_dir))
    tok.save_pretrained(str(base_dir))
    trainer = TorchTrainEngine(copy.deepcopy(base), lr=5e-2, lora=LoraConfig(r=4, alpha=8.0))
    ids = torch.randint(3, 12, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(ids, torch.ones_like(ids), torch.ones(4, 7), torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.zeros(4, 7))
    for _ in range(3):
        trainer.train_step(batch, _pg_loss, 1.0)
    state = trainer.export_weights()
    merged = copy.deepcopy(trainer.model).merge_and_unload().eval()
    app = make_app(base_dir, model_name="tiny", token=None, max_batch=8)
    http, _ = start_http(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{http.server_address[1]}"
    engine = OpenAIEngine(url, sync=AsyncflowSync(), writer=WeightFolderWriter(tmp_path / "sync", base_dir, in_place=False),
                          server_type="asyncflow", request_timeout_s=60, sync_timeout_s=60)
    prompt = [5, 6, 7]

    async def scenario() -> Any:
        await engine.connect(None)
        await engine.load_weights(state, 1, "drain")
        return await engine.generate(GenRequest(0, prompt, 6, 0.0))

    try:
        reply = asyncio.run(scenario())
    finally:
        http.shutdown()
        http.server_close()
        app.engine.shutdown()
    folder = tmp_path / "sync" / "a000001"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    assert reply.token_versions == [1] * len(reply.response_ids)
    with torch.no_grad():
        expected = merged.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
    assert reply.response_ids == expected[: len(reply.response_ids)] and reply.response_ids


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # (peft's own use of it)
def test_save_writes_peft_layout_and_a_checkpoint_resumes(tiny_model: Any, tmp_path: Path) -> None:
    import peft

    engine = _trained(tiny_model)
    engine.lora = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"], save_merged=True)
    engine.save(str(tmp_path / "final"), with_optimizer=False)
    assert (tmp_path / "final" / lora.CONFIG_FILE).is_file() and (tmp_path / "final" / lora.WEIGHTS_FILE).is_file()
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(tmp_path / "final")).eval()
    batch = _batch(seed=3)
    with torch.no_grad():
        assert torch.allclose(token_logprobs(loaded, batch, 1.0)[0], engine.logprobs(batch, 1.0), atol=1e-5)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final" / "merged")).eval()
    with torch.no_grad():
        assert torch.allclose(token_logprobs(merged, batch, 1.0)[0], engine.logprobs(batch, 1.0), atol=1e-5)
    engine.save(str(tmp_path / "ckpt"), with_optimizer=True)
    resumed = TorchTrainEngine(copy.deepcopy(tiny_model), lr=5e-2, lora=SETTINGS)
    resumed.load_optimizer(str(tmp_path / "ckpt"))
    assert torch.allclose(resumed.logprobs(batch, 1.0), engine.logprobs(batch, 1.0), atol=1e-6)
    assert resumed.steps_done == engine.steps_done
    for a, b in ((engine, _batch(seed=4)), (resumed, _batch(seed=4))):
        a.train_step(b, _pg_loss, 1.0)
    assert torch.allclose(resumed.logprobs(batch, 1.0), engine.logprobs(batch, 1.0), atol=1e-6)  # same Adam state


def test_fsdp_lora_matches_the_plain_engine(tiny_model: Any, tmp_path: Path) -> None:
    from asyncflow.engines.fsdp_train import FSDPTrainEngine

    plain = TorchTrainEngine(copy.deepcopy(tiny_model), lr=5e-2, lora=SETTINGS)
    torch.manual_seed(0)
    plain_init = {k: v.clone() for k, v in plain.export_weights().items()}
    fsdp = FSDPTrainEngine(copy.deepcopy(tiny_model), world_size=2, lr=5e-2, lora=SETTINGS)
    try:
        start = fsdp.export_weights()
        assert lora.is_adapter(start) and set(start) == set(plain_init)
        # both start from their own random lora_A (B = 0): align the plain engine to the FSDP one's
        lora.load_adapter_weights(plain.model, _folder(start, tmp_path / "start"))
        batch = _batch(seed=5)
        for _ in range(2):
            plain.train_step(batch, _pg_loss, 1.0)
            fsdp.train_step(batch, _pg_loss, 1.0)
        assert torch.allclose(fsdp.logprobs(batch, 1.0), plain.logprobs(batch, 1.0), atol=1e-4)
        assert torch.allclose(fsdp.reference_logprobs(batch, 1.0), plain.reference_logprobs(batch, 1.0), atol=1e-5)
        state = fsdp.export_weights()
        other = plain.export_weights()
        assert {k: v.shape for k, v in state.items() if k != lora.ADAPTER_KEY} == \
            {k: v.shape for k, v in other.items() if k != lora.ADAPTER_KEY}  # (the marker names each one's base folder)
        fsdp.save(str(tmp_path / "ckpt"), with_optimizer=True)
        assert (tmp_path / "ckpt" / lora.WEIGHTS_FILE).is_file() and (tmp_path / "ckpt" / "optimizer.pt").is_file()
    finally:
        fsdp.close()
    resumed = FSDPTrainEngine(copy.deepcopy(tiny_model), world_size=2, lr=5e-2, lora=SETTINGS)
    try:
        resumed.load_optimizer(str(tmp_path / "ckpt"))
        assert torch.allclose(resumed.logprobs(batch, 1.0), plain.logprobs(batch, 1.0), atol=1e-4)
        resumed.train_step(batch, _pg_loss, 1.0)
        plain.train_step(batch, _pg_loss, 1.0)
        assert torch.allclose(resumed.logprobs(batch, 1.0), plain.logprobs(batch, 1.0), atol=1e-4)  # Adam state too
    finally:
        resumed.close()


def _folder(state: dict[str, torch.Tensor], path: Path) -> Path:
    lora.write_folder(state, path)
    return path


def test_lora_run_publishes_adapter_bytes_and_resumes(arith_dir: Path, tmp_path: Path) -> None:
    """A LoRA run (async, KL on): every train row logs the adapter's bytes, final/ is a PEFT folder,
    and a resumed run goes on from the checkpoint's adapter."""
    import json

    from asyncflow.runner import train

    small = ["train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=4", "eval.size=16", "logging.progress=false",
             f"model.path={arith_dir}", "model.lora.r=4", "train.lr=1e-3", "algorithm.kl_coef=0.05",
             "checkpoint.every=1"]
    out = tmp_path / "run"
    cfg, _ = load_config(None, ["task=arith", *small, "train.max_steps=2"])
    train(cfg, out, progress_enabled=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    full = sum(p.stat().st_size for p in arith_dir.glob("*.safetensors"))
    adapter = (out / "final" / lora.WEIGHTS_FILE).stat().st_size
    assert len(train_rows) == 2
    for r in train_rows:
        assert adapter * 0.9 < r["weight_sync_bytes"] < adapter * 1.1 < full / 10
        assert r["weight_sync_s"] >= 0 and r["kl"] >= 0  # (the reference: the base model, adapter off)
    assert (out / "final" / lora.CONFIG_FILE).is_file() and (out / "checkpoints" / "step_2" / lora.WEIGHTS_FILE).is_file()
    cfg, _ = load_config(None, ["task=arith", *small, "train.max_steps=3", "checkpoint.resume=auto"])
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 48


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_lora_run_on_ray(ray_session: Any, arith_dir: Path, tmp_path: Path, engine: str) -> None:
    """The Ray runtime builds the LoRA trainer through the factory (an actor, or FSDP rank actors): it
    trains, the KL reference comes from the trainer actor, final/ is the adapter."""
    import json

    from asyncflow.runner import train

    fsdp = ["train.engine=fsdp", "train.world_size=2"] if engine == "fsdp" else []
    cfg, _ = load_config(None, ["task=arith",
        f"model.path={arith_dir}", "runtime.kind=ray", "runtime.rollout_cpus=0.5", "runtime.train_cpus=0.5",
        "train.max_steps=2", "train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=4", "eval.size=16",
        "logging.progress=false", "model.lora.r=4", "train.lr=1e-3", "algorithm.kl_coef=0.05", "checkpoint.every=1",
        *fsdp])
    out = tmp_path / "run"
    assert train(cfg, out, progress_enabled=False)["samples"] == 32
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl"] >= 0 for r in rows if r["kind"] == "train"] == [True, True]
    adapter = (out / "final" / lora.WEIGHTS_FILE).stat().st_size  # (the driver held only references: the actor counted)
    assert all(adapter * 0.9 < r["weight_sync_bytes"] < adapter * 1.1 for r in rows if r["kind"] == "train")
    assert not (out / "final" / "model.safetensors").exists()
    cfg.train.max_steps, cfg.checkpoint.resume = 3, "auto"  # the engines get the checkpoint's adapter at version 2
    assert train(cfg, out, progress_enabled=False)["samples"] == 48
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
