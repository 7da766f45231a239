"""`tinker-serve` on asyncflow's other engines, from a run config (`--config`): sampling on an
OpenAI-compatible server (an in-process `asyncflow serve`, fed adapters over its weight route) and,
with `runtime.kind: ray`, training and sampling in Ray actors placed by the run's placement. Each
sampler's log-probs must be the training client's own: the same model, adapter and float32 math."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import yaml
from tinker import types

from asyncflow.cli import main
from asyncflow.config import load_config
from asyncflow.engines.base import GenResult
from asyncflow.tinker.build import make_service
from asyncflow.tinker.sampler_engines import cut_at_stop
from asyncflow.tinker.server import start
from asyncflow.tinker.settings import from_config

BASE = "tiny-base"
PROMPT = [1, 5, 9, 4, 7, 3]


def write_config(tmp_path: Path, raw: dict[str, Any]) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@contextmanager
def served_config(config: Path, notes: list[str] | None = None) -> Iterator[tuple[Any, Any]]:
    """The service a run config describes on a free loopback port, and an SDK client of it."""
    os.environ["TINKER_TELEMETRY"] = "0"
    cfg, explicit = load_config(config, sources=False)
    service = make_service(from_config(cfg, explicit, log=(notes if notes is not None else []).append))
    server, _ = start(service, "127.0.0.1", 0)
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{server.server_address[1]}", api_key="tml-test") as sdk:
            yield service, sdk
    finally:
        server.shutdown()
        server.server_close()
        service.shutdown()


def trained_client(sdk: Any, steps: int = 3) -> Any:
    """A training client whose adapter a few cross-entropy steps have moved away from the base model."""
    tc = sdk.create_lora_training_client(base_model=BASE, rank=2, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return tc


def training_logprobs(tc: Any) -> np.ndarray:
    """The training client's log-probs of PROMPT[1:] (its current weights)."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})
    out = tc.forward([datum], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist())


def sampler_logprobs(sampler: Any) -> np.ndarray:
    return np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()[1:], dtype=np.float64)


def check_samplers_match_training(sdk: Any) -> None:
    """Base and trained samplers give their training client's log-probs, and sample tokens."""
    fresh = sdk.create_lora_training_client(base_model=BASE, rank=2, seed=0).result()  # (B = 0: the base model)
    base = sampler_logprobs(sdk.create_sampling_client(base_model=BASE).result())
    assert base == pytest.approx(training_logprobs(fresh), abs=1e-4)
    tc = trained_client(sdk)
    trained = sampler_logprobs(tc.save_weights_and_get_sampling_client().result())
    assert trained == pytest.approx(training_logprobs(tc), abs=1e-4)
    assert not np.allclose(trained, base, atol=1e-2)  # (the adapter reached the sampler)
    # the base model again on the same engine: the adapter is not left behind
    assert sampler_logprobs(sdk.create_sampling_client(base_model=BASE).result()) == pytest.approx(base, abs=1e-4)
    sampler = tc.save_weights_and_get_sampling_client().result()
    reply = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=2,
                           sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)).result()
    assert len(reply.sequences) == 2
    for seq in reply.sequences:
        assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)


def test_a_server_sampler_gets_each_snapshot_by_adapter_and_matches_training(serve_dir: Path, tmp_path: Path,
                                                                            make_server: Any) -> None:
    server = make_server(max_batch=8)
    config = write_config(tmp_path, {
        "model": {"path": str(serve_dir), "device": "cpu"},
        "rollout": {"engine": "openai", "server_urls": [server.url], "server_type": "asyncflow"},
        "dataset": {"path": str(tmp_path / "rows.jsonl")},
    })
    notes: list[str] = []
    with served_config(config, notes) as (service, sdk):
        check_samplers_match_training(sdk)
        assert service.sampling.counts["engines_built"] == 1  # (one server: one engine, reloaded per snapshot)
    # what a run config sets that the client's loop owns is named, not silently dropped
    assert any("not used: dataset.path" in n for n in notes), notes
    assert server.app.engine.version > 0  # (the server took weight loads)


def test_samples_from_an_engine_that_does_not_stop_early_are_cut_at_their_first_stop() -> None:
    class Tok:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(96 + i) for i in ids)

    result = GenResult(7, [1, 2, 3, 4, 5], [-0.1, -0.2, -0.3, -0.4, -0.5], [0] * 5, "length")
    by_id = cut_at_stop(result, frozenset({3}), [], Tok())
    assert (by_id.response_ids, by_id.behavior_logprobs, by_id.finish_reason) == ([1, 2, 3], [-0.1, -0.2, -0.3], "stop")
    by_text = cut_at_stop(result, frozenset(), ["cd"], Tok())
    assert by_text.response_ids == [1, 2, 3, 4] and by_text.finish_reason == "stop"
    assert cut_at_stop(result, frozenset({9}), ["zz"], Tok()) is result


def test_the_command_reads_a_config_and_refuses_a_bad_one_in_one_line(serve_dir: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_config(tmp_path, {"model": {"path": str(serve_dir)}, "rollout": {"engine": "openai"}})
    assert main(["tinker-serve", "--config", str(bad)]) == 2
    assert main(["tinker-serve"]) == 2
    none = write_config(tmp_path, {"seed": 1})
    assert main(["tinker-serve", "--config", str(none)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3, errors
    assert "rollout.server_urls" in errors[0] and "--config" in errors[1] and "model.path" in errors[2]
    cfg, explicit = load_config(None, [f"model.path={serve_dir}", "rollout.workers=2", "workflow.max_staleness=1",
                                       "train.engine=fsdp", "train.world_size=2"], sources=False)
    settings = from_config(cfg, explicit, log=print)
    assert (settings.model_dir, settings.max_engines, settings.max_staleness) == (serve_dir, 2, 1)
    assert (settings.trainer, settings.world_size, settings.sampler, settings.ray) == ("fsdp", 2, "hf", False)


@pytest.mark.ray
def test_on_ray_training_and_sampling_run_in_placed_actors(serve_dir: Path, tmp_path: Path, ray_session: Any) -> None:
    """FSDP ranks (2, each an actor) and an hf sampler actor; the torch trainer's actor is the next test's."""
    from ray.util import list_named_actors

    config = write_config(tmp_path, {
        "model": {"path": str(serve_dir), "device": "cpu"},
        "rollout": {"workers": 1},
        "train": {"engine": "fsdp", "world_size": 2},
        "runtime": {"kind": "ray", "rollout_cpus": 0.5, "train_cpus": 0.5},
    })
    with served_config(config) as (service, sdk):
        check_samplers_match_training(sdk)
        names = [n for n in list_named_actors() if n.startswith("asyncflow-tinker-")]  # (samplers start on demand)
        assert len([n for n in names if "-train-rank" in n]) == 2 and any("-sampler0-" in n for n in names), names
        assert service.sampling.counts["engines_built"] == 1
        # a sampler actor that dies is replaced by a new one when the next session needs an engine
        ray_session.kill(ray_session.get_actor(next(n for n in names if "-sampler0-" in n)))
        base = sampler_logprobs(sdk.create_sampling_client(base_model=BASE).result())
        assert np.isfinite(base).all() and service.sampling.counts["engines_built"] == 2
    assert not [n for n in list_named_actors() if n.startswith("asyncflow-tinker-")]  # (stopped with the service)


@pytest.mark.ray
def test_on_ray_the_service_starts_its_own_servers_and_samples_on_them(serve_dir: Path, tmp_path: Path,
                                                                      ray_session: Any) -> None:
    from ray.util import list_named_actors

    config = write_config(tmp_path, {
        "model": {"path": str(serve_dir), "device": "cpu"},
        "rollout": {"engine": "openai", "launch_servers": "asyncflow", "workers": 1, "server_start_timeout_s": 120},
        "runtime": {"kind": "ray", "rollout_cpus": 0.5, "train_cpus": 0.5},
    })
    with served_config(config) as (service, sdk):
        names = [n for n in list_named_actors() if n.startswith("asyncflow-tinker-")]
        assert any(n.endswith("-server-0") for n in names) and any("-train-0" in n for n in names), names
        check_samplers_match_training(sdk)
        assert service.sampling.counts["engines_built"] == 1
    assert not [n for n in list_named_actors() if n.startswith("asyncflow-tinker-")]
