"""Building a Tinker service from its settings (`settings.ServeSettings`): the training backend
(`TrainingModels` here, FSDP ranks, or a Ray actor), the sampling engines' factory (hf, vllm, openai;
here or in Ray actors) and the service around them. Everything built is stopped again if a later
part fails to start."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError
from asyncflow.tinker.sampler_engines import SamplerEngine
from asyncflow.tinker.service import TinkerService
from asyncflow.tinker.settings import ServeSettings

START_TIMEOUT_S = 300.0  # an engine or actor loading the model; a server answering


def make_service(settings: ServeSettings, *, api_key: str | None = None,
                 state_dir: Path | None = None) -> TinkerService:
    """The service: base model for training, its tokenizer for stops, the sampling engines; checkpoints
    in memory or in files under `state_dir` (created if missing)."""
    from asyncflow.data import generation_stop_ids
    from asyncflow.engines.base import quiet_transformers
    from asyncflow.model_folder import check_model_dir
    from asyncflow.tinker.sampling import SamplingPool
    from asyncflow.tinker.stream import StreamState
    from asyncflow.tokenizer import load_tokenizer

    quiet_transformers()  # (engines load models while the service runs: no progress bars between its lines)
    model_dir, key = settings.model_dir, settings.key
    if state_dir is not None:
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"tinker-serve --state-dir {state_dir}: cannot create the folder: {exc}") from None
    check_model_dir(model_dir, key=key)
    tok = load_tokenizer(model_dir, key=key)
    eos = int(tok.eos_token_id)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else eos)
    eos_ids = [eos, *generation_stop_ids(model_dir, eos)]
    parts = Parts(settings, eos_ids, pad)
    try:
        training = parts.training()
        sampling = SamplingPool(model_dir, tok, eos_ids, pad, max_engines=settings.max_engines,
                                max_batch=settings.max_batch, device=settings.device, make_engine=parts.sampler())
    except BaseException:
        parts.close()
        raise
    service = TinkerService(training, sampling, api_key=api_key, tokenizer_id=str(model_dir.resolve()),
                            stream=StreamState(settings.max_staleness), state_dir=state_dir,
                            model_name=model_dir.name)
    service.on_shutdown(parts.close)
    return service


class Parts:
    """What the settings ask for, built on demand: Ray (joined or started) and its placement group,
    the servers it starts (`rollout.launch_servers`), the work folder of server samplers (adapter
    folders, server logs); `close` frees them."""

    def __init__(self, settings: ServeSettings, eos_ids: list[int], pad_id: int) -> None:
        self.settings, self.eos_ids, self.pad_id = settings, eos_ids, pad_id
        self.placement: Any = None
        self.servers: Any = None  # `ray_servers.Servers` started for the service
        self._work_dir: Path | None = None
        self._names = iter(range(1 << 30))

    def close(self) -> None:
        if self.servers is not None:
            self.servers.stop()
            self.servers = None
        if self.placement is not None:
            with contextlib.suppress(Exception):  # (a failed server start removed it already)
                self.placement.remove()
            self.placement = None
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    @property
    def work_dir(self) -> Path:
        """A temporary folder of the service's: adapter folders for servers without `rollout.sync_dir`."""
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="asyncflow-tinker-"))
        return self._work_dir

    def training(self) -> Any:
        s = self.settings
        if s.ray:
            return self._ray_training()
        if s.trainer == "fsdp":
            from asyncflow.tinker.fsdp_training import FSDPTrainingModels

            return FSDPTrainingModels(s.model_dir, world_size=s.world_size, device=_device(s.device),
                                      threads=self._rank_threads(), timeout_s=s.worker_timeout_s)
        from asyncflow.engines.base import pick_device
        from asyncflow.tinker.training import TrainingModels

        try:
            return TrainingModels(s.model_dir, pick_device(s.device, 0))
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"{s.key}: cannot load the model in {s.model_dir}: {type(exc).__name__}: {exc}") from None

    def _rank_threads(self) -> int:
        """torch threads per FSDP rank: `runtime.torch_threads`; else, on Ray, the rank's reserved CPUs,
        and here this process's cores shared by the ranks."""
        from asyncflow.config_schema import usable_cores

        s, cfg = self.settings, self.settings.cfg
        if cfg is not None and cfg.runtime.torch_threads is not None:
            return cfg.runtime.torch_threads
        if s.ray and cfg is not None:
            return max(1, int(cfg.runtime.train_cpus))
        return max(1, usable_cores() // s.world_size)

    def _reserve(self) -> Any:
        """Ray joined or started (`runtime.address`) and the placement group reserved, once."""
        if self.placement is None:
            from asyncflow.runtime.ray_init import ensure_ray
            from asyncflow.runtime.ray_placement import reserve

            cfg = self.settings.cfg
            assert cfg is not None  # (runtime.kind: ray comes from a config)
            ensure_ray(cfg.runtime.address)
            rollout = dataclasses.replace(cfg.rollout, workers=self.settings.max_engines)
            runtime = cfg.runtime
            if self.settings.sampler == "openai" and rollout.launch_servers is None:  # (the user's servers: nothing
                runtime = dataclasses.replace(runtime, rollout_cpus=0.0, rollout_gpus=0.0, rollout_resource=None)  # to place)
            self.placement = reserve(dataclasses.replace(cfg, rollout=rollout, runtime=runtime), 0,
                                     prefix=f"asyncflow-tinker-{secrets.token_hex(4)}")
        return self.placement

    def _options(self, i: int, name: str) -> dict[str, Any]:
        options = self._reserve().options(i, f"{name}-{next(self._names)}")
        options.pop("max_restarts", None)  # (a dead engine is replaced by the pool, not restarted by Ray)
        options.pop("max_task_retries", None)
        return options  # type: ignore[no-any-return]

    def _ray_training(self) -> Any:
        s = self.settings
        first = s.max_engines  # (the trainer's bundles follow the samplers')
        if s.trainer == "fsdp":
            from asyncflow.runtime.ray_fsdp import RayRankLinks
            from asyncflow.tinker.fsdp_training import FSDPTrainingModels

            options = [self._options(first + r, f"train-rank{r}") for r in range(s.world_size)]
            return FSDPTrainingModels(s.model_dir, world_size=s.world_size, device=_device(s.device),
                                      threads=self._rank_threads(), timeout_s=s.worker_timeout_s,
                                      links=lambda spec: RayRankLinks(spec, options))
        from asyncflow.tinker.remote import RemoteTraining

        assert s.cfg is not None
        device = "cuda" if s.cfg.runtime.train_gpus >= 1 and s.device != "cpu" else "cpu"
        return RemoteTraining.start(s.model_dir, device, self._options(first, "train"), START_TIMEOUT_S)

    def sampler(self) -> Callable[[int], SamplerEngine] | None:
        """The pool's engine factory (None: its own, `HFEngine`s here)."""
        s = self.settings
        if s.sampler == "openai":
            if s.cfg is not None and s.cfg.rollout.launch_servers is not None:
                self._launched()  # (started now: a server that cannot start fails the command, not a request)
            return self._server_sampler
        if s.ray or s.sampler == "vllm":
            return self._engine_sampler
        return None

    def _spec(self) -> Any:
        from asyncflow.tinker.remote import SamplerSpec

        s = self.settings
        on_gpu = s.device != "cpu" and (not s.ray or (s.cfg is not None and s.cfg.runtime.rollout_gpus > 0))
        return SamplerSpec(s.sampler, str(s.model_dir), tuple(self.eos_ids), self.pad_id, s.max_batch, s.dtype,
                           s.seed, "cuda" if on_gpu and _device(s.device) == "cuda" else "cpu", s.lora_rank)

    def _engine_sampler(self, index: int) -> SamplerEngine:
        from asyncflow.tinker.remote import RaySampler, build_sampler

        if self.settings.ray:
            return RaySampler.start(self._spec(), index, self._options(index, f"sampler{index}"), START_TIMEOUT_S)
        return build_sampler(self._spec(), index)

    def _server_sampler(self, index: int) -> SamplerEngine:
        from asyncflow.engines.openai_engine import make_openai_engine
        from asyncflow.tinker.sampler_engines import LoopSampler

        cfg = self.settings.cfg
        assert cfg is not None  # (openai sampling comes from a config)
        rollout, link = cfg.rollout, None
        if rollout.launch_servers is not None:
            from asyncflow.runtime.ray_servers import server_link

            rollout = dataclasses.replace(rollout, server_urls=self._launched().urls)
            link = server_link(cfg, self.placement.prefix, index)
        assert rollout.server_urls  # (config validation requires them, or launch_servers)
        engine = make_openai_engine(rollout, index, self.settings.model_dir, self.work_dir, session=f"tinker-{index}")
        engine.server = link  # (a started server: its token, and its restart when it dies)
        sampler = LoopSampler(engine, f"server sampler {index} ({engine.base_url})",
                              merges_adapters=cfg.rollout.server_type == "asyncflow")
        try:
            sampler.connect(cfg.rollout.sync_timeout_s)
        except BaseException:
            sampler.shutdown()
            raise
        return sampler

    def _launched(self) -> Any:
        """The servers `rollout.launch_servers` names, started once in the samplers' bundles."""
        if self.servers is None:
            from asyncflow.runtime.ray_servers import start_servers

            cfg = self.settings.cfg
            assert cfg is not None
            cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, workers=self.settings.max_engines))
            self.servers = start_servers(cfg, self._reserve(), str(self.settings.model_dir), self.work_dir)
        return self.servers


def _device(setting: str) -> str:
    """cpu or cuda, as `model.device` resolves in this process."""
    from asyncflow.engines.base import pick_device

    return "cpu" if pick_device(setting, 0) == "cpu" else "cuda"
