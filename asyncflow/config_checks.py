"""Validation of a loaded config: settings that cannot be honoured together, keys set for a feature
that is off, and choices this machine cannot run, each refused with a one-line error naming the key.

No heavy imports: the CLI validates before torch/transformers/ray load.
"""

from __future__ import annotations

import importlib.util
import urllib.parse

from asyncflow.config_schema import Config, clip_defaults, episodic, max_generated_tokens
from asyncflow.envs.verifiers_env import is_verifiers_spec
from asyncflow.errors import UserError
from asyncflow.hub import hub_id
from asyncflow.rewards.sandbox_verify import PROBED as SANDBOX_LAYERS
from asyncflow.tasks import TASK_NAMES


def validate(cfg: Config, explicit: set[str], *, require_packages: bool = True, sources: bool = True) -> None:
    """Cross-field checks: settings that cannot be honoured together are refused, never ignored.
    `require_packages`: an optional package the config needs and this Python lacks is refused too
    (last: every other check runs first; `missing_packages` lists them without refusing). `sources`
    False: where prompts and rewards come from is not checked (tinker-serve: its clients bring them)."""
    if cfg.train.batch_size % cfg.rollout.n:
        raise UserError(
            f"train.batch_size: {cfg.train.batch_size} is not divisible by rollout.n={cfg.rollout.n} (a batch is whole groups)"
        )
    if cfg.train.batch_size < cfg.train.mini_batches:
        raise UserError(f"train.mini_batches: {cfg.train.mini_batches} is more than train.batch_size={cfg.train.batch_size}")
    if cfg.workflow.mode == "sync" and cfg.workflow.max_staleness not in (None, 0):
        raise UserError(
            f"workflow.max_staleness: {cfg.workflow.max_staleness} contradicts workflow.mode=sync (sync is staleness 0)"
        )
    # (in this order: of several problems, the first one found is the one reported)
    if sources:
        _validate_sources(cfg, explicit)
    _validate_algorithm(cfg, explicit)
    _validate_servers(cfg, explicit)
    _validate_engines(cfg, explicit)
    _validate_outputs(cfg, explicit)
    _validate_scoped_keys(cfg, explicit)
    missing = missing_packages(cfg) if require_packages else []
    if missing:
        raise UserError(missing[0])


def missing_packages(cfg: Config) -> list[str]:
    """One line per optional package the (otherwise valid) config needs and this Python lacks,
    naming the key that needs it."""
    kind = cfg.rollout.launch_servers
    wanted = [
        (kind in LAUNCHABLE and kind != "asyncflow", LAUNCHABLE.get(kind or "", ""),
         f"rollout.launch_servers: {kind} is not installed in this Python (asyncflow works here)"),
        (cfg.model.lora is not None, "peft", "model.lora: the peft package is not installed (pip install 'asyncflow[lora]')"),
        (cfg.rollout.engine == "vllm", "vllm",
         "rollout.engine: vllm is not installed (pip install 'asyncflow[vllm]', needs a GPU); use hf"),
        (cfg.logging.tensorboard, "tensorboard",
         "logging.tensorboard: the tensorboard package is not installed (pip install tensorboard)"),
        (cfg.logging.wandb, "wandb", "logging.wandb: the wandb package is not installed (pip install wandb)"),
    ]
    return [line for needed, module, line in wanted if needed and importlib.util.find_spec(module) is None]


def _validate_sources(cfg: Config, explicit: set[str]) -> None:
    """Where the model, prompts and rewards come from: the task pack, an agent, an environment or reward.fn."""
    if cfg.rollout.agent is not None:
        _validate_agent(cfg, explicit)
    _validate_group_timeout(cfg, explicit)
    if cfg.rollout.turn_barrier and cfg.rollout.env is None:
        raise UserError("rollout.turn_barrier: only used with rollout.env (multi-turn episodes)")
    if cfg.rollout.env is not None and cfg.reward.fn is not None and "reward.fn" in explicit:
        raise UserError("reward.fn: not used with rollout.env (an episode's reward is the sum of its environment's "
                        "step rewards); remove one of them")
    if cfg.task is None:
        own_tasks = is_verifiers_spec(cfg.rollout.agent)  # (a verifiers environment brings its prompts)
        for key in ("model.path", *(() if own_tasks else ("dataset.path",)), *(() if episodic(cfg) else ("reward.fn",))):
            section, name = key.split(".")
            if getattr(getattr(cfg, section), name) is None:
                raise UserError(f"{key}: required when task is null (no task pack to supply it; a pack is named with "
                                f"task: {' / '.join(TASK_NAMES)})")
    if "model.task_seed" in explicit and (cfg.task is None or cfg.model.path is not None):
        raise UserError("model.task_seed: not used with " + ("task null" if cfg.task is None else "model.path set")
                        + " (it seeds the task pack's own base model)")
    if "dataset.config" in explicit and not any(p is not None and hub_id(p) for p in (cfg.dataset.path, cfg.eval.path)):
        raise UserError("dataset.config: only used with a Hugging Face Hub dataset id in dataset.path or eval.path")
    if cfg.rollout.env is not None and cfg.rollout.env not in ENV_NAMES and ":" not in cfg.rollout.env:
        raise UserError(f"rollout.env: {cfg.rollout.env!r} is neither a built-in ({', '.join(ENV_NAMES)}) nor 'module:factory'")
    _validate_reward_fns(cfg)


def _validate_group_timeout(cfg: Config, explicit: set[str]) -> None:
    """The straggler deadline cuts single-turn requests, before the request timeout fails them."""
    ro = cfg.rollout
    if ro.group_timeout_s is None:
        if "rollout.group_min_samples" in explicit:
            raise UserError("rollout.group_min_samples: only used with rollout.group_timeout_s")
        return
    if episodic(cfg):
        raise UserError("rollout.group_timeout_s: single-turn requests only (not with rollout.env or rollout.agent)")
    if ro.group_timeout_s >= ro.request_timeout_s:
        raise UserError(f"rollout.group_timeout_s: {ro.group_timeout_s:g} must be below rollout.request_timeout_s="
                        f"{ro.request_timeout_s:g} (a request past that fails the run)")
    if ro.group_min_samples > ro.n:
        raise UserError(f"rollout.group_min_samples: {ro.group_min_samples} is more than rollout.n={ro.n}")


def _validate_reward_fns(cfg: Config) -> None:
    """`reward.fn` (one or a list) names functions; `reward.weights` has one weight per function;
    `reward.sandbox_require` names sandbox layers."""
    unknown = [x for x in cfg.reward.sandbox_require or () if x not in SANDBOX_LAYERS]
    if unknown:
        raise UserError(f"reward.sandbox_require: unknown layer {unknown[0]!r}; the layers are: {', '.join(SANDBOX_LAYERS)}")
    fns = [cfg.reward.fn] if isinstance(cfg.reward.fn, str) else cfg.reward.fn
    if fns is not None and not fns:
        raise UserError("reward.fn: an empty list (give at least one 'module:function', or null for the task's)")
    for fn in fns or ():
        if ":" not in fn.removeprefix("verl:"):
            raise UserError(f"reward.fn: {fn!r} must be 'module:function' or 'path/to/file.py:function'")
    weights = cfg.reward.weights
    if weights is not None and len(weights) != len(fns or [None]):  # (null fn: the task's one verifier)
        raise UserError(f"reward.weights: {len(weights)} weights for {len(fns or [None])} reward functions "
                        "(reward.fn); give one weight per function")


def _validate_outputs(cfg: Config, explicit: set[str]) -> None:
    """Logging backends, early stopping and periodic checkpoints."""
    if "logging.wandb_project" in explicit and not cfg.logging.wandb:
        raise UserError("logging.wandb_project: not used while logging.wandb is false")
    if cfg.eval.patience > 0 and cfg.eval.every == 0:
        raise UserError("eval.patience: needs eval.every > 0 (evaluations during training to watch)")
    if "eval.min_delta" in explicit and cfg.eval.patience == 0:
        raise UserError("eval.min_delta: not used while eval.patience is 0 (no early stop)")
    if "checkpoint.keep" in explicit and cfg.checkpoint.every == 0:
        raise UserError("checkpoint.keep: not used while checkpoint.every is 0 (no periodic checkpoints)")


def _validate_scoped_keys(cfg: Config, explicit: set[str]) -> None:
    """Keys only one runtime, rollout kind or feature reads are refused without it; and a Ray address
    must be one Ray can join, and a Ray run on cuda must give its actors GPUs."""
    if cfg.runtime.address is not None and cfg.runtime.kind == "local":
        raise UserError("runtime.address: only used with runtime.kind=ray")
    if cfg.runtime.address is not None:
        _check_ray_address(cfg.runtime.address)
    if cfg.runtime.kind == "local":
        for key in _RAY_KEYS:
            if f"runtime.{key}" in explicit:
                raise UserError(f"runtime.{key}: only used with runtime.kind=ray (kind is local)")
    if cfg.rollout.env is None:
        for key in ("env_latency_s", "env_timeout_s"):
            if f"rollout.{key}" in explicit:
                raise UserError(f"rollout.{key}: only used with rollout.env (multi-turn environments)")
    if episodic(cfg):  # an episode's reward comes from its environment or agent: no reward function runs
        for key in ("timeout_s", "concurrency", "weights"):
            if f"reward.{key}" in explicit:
                raise UserError(f"reward.{key}: not used with rollout.env or rollout.agent (no reward function "
                                "runs: an episode is scored by its environment or agent)")
    if episodic(cfg) and cfg.eval.lenient_fn is not None:
        raise UserError("eval.lenient_fn: single-turn runs only (an episode's reward comes from its environment or agent)")
    if "eval.lenient_tokens" in explicit and not _has_lenient_check(cfg):
        raise UserError("eval.lenient_tokens: only used with eval.lenient_fn (or a task pack's own looser check)")
    if not episodic(cfg) and "rollout.max_turns" in explicit:
        raise UserError("rollout.max_turns: only used with rollout.env or rollout.agent (multi-turn episodes)")
    if cfg.rollout.agent is None and "rollout.agent_timeout_s" in explicit:
        raise UserError("rollout.agent_timeout_s: only used with rollout.agent")
    if not cfg.algorithm.filter_groups and "algorithm.filter_max_groups_per_step" in explicit:
        raise UserError("algorithm.filter_max_groups_per_step: not used while algorithm.filter_groups is false")
    if cfg.runtime.weight_sync == "collective" and cfg.rollout.engine == "openai":
        raise UserError("runtime.weight_sync: collective reaches in-process engines only; rollout.engine=openai "
                        "servers load each version from rollout.sync_dir (use object_store)")
    if "runtime.weight_bucket_mb" in explicit and cfg.runtime.weight_sync != "collective":
        raise UserError("runtime.weight_bucket_mb: only used with runtime.weight_sync=collective")
    if cfg.runtime.kind == "ray" and cfg.model.device == "cuda" and not (cfg.runtime.rollout_gpus and cfg.runtime.train_gpus):
        raise UserError("model.device: cuda with runtime.kind=ray needs runtime.rollout_gpus and runtime.train_gpus "
                        "above 0 (Ray shows an actor only the GPUs it was given)")


def _has_lenient_check(cfg: Config) -> bool:
    """Whether the evaluation takes a second, looser look (`eval.lenient_fn`, or the task pack's with its reward)."""
    if cfg.eval.lenient_fn is not None:
        return True
    if cfg.task is None or cfg.reward.fn:
        return False
    from asyncflow.tasks import get_task

    return bool(get_task(cfg.task).lenient_fn_path)


def _check_ray_address(address: str) -> None:
    """`auto`, HOST:PORT or ray://HOST:PORT (what `ray.init` joins); anything else was a traceback
    from inside Ray (`foo`: ValueError), or a dashboard URL that Ray retried for minutes."""
    if address.startswith(("http://", "https://")):
        raise UserError(f"runtime.address: {address!r} is a web address (the dashboard's or job submission's?); "
                        "give the head's HOST:PORT from `ray start --head` (port 6379 by default) or ray://HOST:PORT")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address != "auto" and not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"runtime.address: expected auto, HOST:PORT or ray://HOST:PORT, got {address!r}")


ENV_NAMES = ("calculator", "guess_number")
# runtime.* keys only the Ray runtime reads (placement of its actors)
_RAY_KEYS = ("rollout_cpus", "rollout_gpus", "train_cpus", "train_gpus", "reward_workers", "reward_cpus",
             "placement_strategy", "max_restarts", "train_resource", "rollout_resource", "weight_sync",
             "weight_bucket_mb", "colocate")


def _validate_agent(cfg: Config, explicit: set[str]) -> None:
    """rollout.agent replaces both the environment and the reward function."""
    agent = cfg.rollout.agent
    assert agent is not None
    if ":" not in agent:
        raise UserError(f"rollout.agent: {agent!r} must be 'module:function' or 'verifiers:TASKSET'")
    if cfg.rollout.env is not None:
        raise UserError("rollout.agent: not used with rollout.env (the agent is its own environment); remove one of them")
    if cfg.reward.fn is not None and "reward.fn" in explicit:
        raise UserError("reward.fn: not used with rollout.agent (an agent episode's reward is what the agent "
                        "returns); remove one of them")


_SERVER_KEYS = ("server_urls", "server_type", "server_model", "server_token_env", "sync_dir", "sync_timeout_s",
                "launch_servers", "server_start_timeout_s")
LAUNCHABLE = {"asyncflow": "asyncflow", "vllm": "vllm", "sglang": "sglang"}  # launch_servers -> its Python module


def _validate_servers(cfg: Config, explicit: set[str]) -> None:
    """rollout.engine=openai needs its servers; its keys are refused with any other engine."""
    ro = cfg.rollout
    if ro.engine != "openai":
        for key in _SERVER_KEYS:
            if f"rollout.{key}" in explicit:
                raise UserError(f"rollout.{key}: only used with rollout.engine=openai (engine is {ro.engine})")
        return
    if ro.launch_servers is not None or "rollout.server_start_timeout_s" in explicit:
        _validate_launch(cfg, explicit)
        return
    if not ro.server_urls:
        raise UserError("rollout.server_urls: rollout.engine=openai needs at least one server URL (e.g. http://127.0.0.1:8000), "
                        "or rollout.launch_servers with runtime.kind=ray")
    for url in ro.server_urls:
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
            raise UserError(f"rollout.server_urls: {url!r} is not an http:// or https:// URL")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018  (parsing it is the check: out of range or not a number raises)
        except ValueError as exc:
            raise UserError(f"rollout.server_urls: {url!r}: {exc}") from None
        if not parts.hostname:
            raise UserError(f"rollout.server_urls: {url!r} has no host")
    if len(set(u.rstrip("/") for u in ro.server_urls)) != len(ro.server_urls):
        raise UserError("rollout.server_urls: a server is listed twice")
    if "rollout.workers" in explicit and ro.workers != len(ro.server_urls):
        raise UserError(f"rollout.workers: {ro.workers} contradicts rollout.server_urls ({len(ro.server_urls)} servers, "
                        "one rollout worker each); remove rollout.workers")
    ro.workers = len(ro.server_urls)  # resolved: one rollout worker per server
    if ro.server_type == "vllm" and ro.sync_dir is None:
        raise UserError("rollout.sync_dir: required with rollout.server_type=vllm (the folder the vLLM server was "
                        "started from; vLLM reloads its weights in place)")


def _validate_launch(cfg: Config, explicit: set[str]) -> None:
    """rollout.launch_servers: the Ray runtime starts rollout.workers servers itself (no server_urls)."""
    ro = cfg.rollout
    kind = ro.launch_servers
    if kind is None:
        raise UserError("rollout.server_start_timeout_s: only used with rollout.launch_servers")
    if kind not in LAUNCHABLE:
        raise UserError(f"rollout.launch_servers: expected asyncflow, vllm, sglang or null, got {kind!r}")
    if cfg.runtime.kind != "ray":
        raise UserError("rollout.launch_servers: only with runtime.kind=ray (locally, start the servers yourself "
                        "and list them in rollout.server_urls)")
    if ro.server_urls:
        raise UserError("rollout.server_urls: not used with rollout.launch_servers (the run starts its own servers "
                        "and finds their URLs); remove one of them")
    if "rollout.server_token_env" in explicit:
        raise UserError("rollout.server_token_env: not used with rollout.launch_servers (the run gives each server "
                        "it starts a random token of its own); remove it")
    if "rollout.server_type" in explicit and ro.server_type != kind:
        raise UserError(f"rollout.server_type: {ro.server_type} contradicts rollout.launch_servers={kind}; "
                        "remove rollout.server_type")
    ro.server_type = kind  # type: ignore[assignment]  # resolved: the servers the run starts are of this type
    if kind == "vllm" and ro.sync_dir is None:
        raise UserError("rollout.sync_dir: required with rollout.launch_servers=vllm (a single-file copy of the model "
                        "folder: vllm serve starts from it and reloads model.safetensors there in place)")


def _validate_engines(cfg: Config, explicit: set[str]) -> None:
    """Engine choices the chosen runtime and batch shape can honour (no heavy imports)."""
    t = cfg.train
    if t.engine != "fsdp":
        for key in ("world_size", "worker_timeout_s"):
            if f"train.{key}" in explicit:
                raise UserError(f"train.{key}: only used with train.engine=fsdp (engine is {t.engine})")
    else:
        if cfg.runtime.weight_sync_delta:
            raise UserError("runtime.weight_sync_delta: needs train.engine=torch (an FSDP trainer's export is "
                            "gathered on its rank 0, where no last published copy is kept)")
        if t.batch_size % (t.world_size * t.mini_batches):
            raise UserError(
                f"train.world_size: batch_size={t.batch_size} is not divisible by world_size x mini_batches="
                f"{t.world_size} x {t.mini_batches} (every rank takes an equal share of each optimizer step)"
            )
    if "train.min_lr_ratio" in explicit and t.lr_schedule != "cosine":
        raise UserError(f"train.min_lr_ratio: only used with train.lr_schedule=cosine (it is {t.lr_schedule})")
    if cfg.model.lora is not None:
        _validate_lora(cfg)
    if cfg.rollout.engine == "vllm" and cfg.runtime.kind == "ray" and cfg.runtime.rollout_gpus < 1:
        raise UserError(f"runtime.rollout_gpus: {cfg.runtime.rollout_gpus:g} with rollout.engine=vllm on Ray; "
                        "each rollout actor's vLLM needs a GPU of its own (set runtime.rollout_gpus=1)")


def _validate_lora(cfg: Config) -> None:
    """`model.lora`: target modules named."""
    assert cfg.model.lora is not None
    targets = cfg.model.lora.target_modules
    if not targets or (isinstance(targets, list) and not all(targets)):
        raise UserError("model.lora.target_modules: empty (name modules, e.g. [q_proj, v_proj], or all-linear)")


def _validate_distill(cfg: Config, explicit: set[str]) -> None:
    """`algorithm.distill`: a teacher named; a server's prompt log-probs are the unscaled model's."""
    d = cfg.algorithm.distill
    assert d is not None
    if not d.teacher:
        raise UserError("algorithm.distill.teacher: required (a model folder, or a server's http://HOST:PORT/v1)")
    server = is_server_teacher(d.teacher)
    if server and cfg.rollout.temperature != 1.0:
        raise UserError(f"algorithm.distill.teacher: a server teacher's prompt log-probs are the model's at temperature "
                        f"1, but rollout.temperature is {cfg.rollout.temperature:g} (the reverse KL compares "
                        "log-probs at the sampling temperature); use a teacher folder or temperature 1")
    for key in ("timeout_s", "token_env"):
        if not server and f"algorithm.distill.{key}" in explicit:
            raise UserError(f"algorithm.distill.{key}: only used by a server teacher (http://...)")
    if server and "algorithm.distill.device" in explicit:
        raise UserError("algorithm.distill.device: only used by a teacher folder (the server places its own model)")
    if d.coef == 0 and d.reward_coef == 0:
        raise UserError("algorithm.distill: coef and reward_coef are both 0 (every advantage would be 0)")


def is_server_teacher(teacher: str) -> bool:
    """A distillation teacher reached over HTTP (else a model folder)."""
    return teacher.startswith(("http://", "https://"))


# algorithm.* keys each loss reads; a key set explicitly for a loss that does not read it is refused
_LOSS_KEYS: dict[str, tuple[str, ...]] = {
    "ppo": ("clip_low", "clip_high", "dual_clip"),
    "decoupled_ppo": ("clip_low", "clip_high", "dual_clip", "is_level", "is_cap", "is_mode"),
    "tis": ("is_level", "is_cap"),
    "mis": ("is_level", "is_cap"),
    "cispo": ("clip_low", "clip_high"),
    "topr": ("is_level",),
    "gspo": ("clip_low", "clip_high"),
    "reinforce": (),
    "m2po": ("m2_threshold",),
    "icepop": ("icepop_low", "icepop_high"),
}


def _validate_algorithm(cfg: Config, explicit: set[str]) -> None:
    a = cfg.algorithm
    if a.loss == "gspo" and "algorithm.agg" not in explicit:
        a.agg = "seq_mean_token_mean"  # GSPO's own aggregation (a mean over sequences), unless asked otherwise
    low, high = clip_defaults(a.loss)
    a.clip_low = low if a.clip_low is None else a.clip_low  # resolved per loss (config.yaml shows the value)
    a.clip_high = high if a.clip_high is None else a.clip_high
    used = _LOSS_KEYS[a.loss]
    for key in dict.fromkeys(k for keys in _LOSS_KEYS.values() for k in keys):
        if f"algorithm.{key}" in explicit and key not in used:
            users = ", ".join(loss for loss, keys in _LOSS_KEYS.items() if key in keys)
            raise UserError(f"algorithm.{key}: not used by algorithm.loss={a.loss} (used by: {users}); remove it")
    if a.loss == "m2po" and a.m2_threshold <= 0:
        raise UserError("algorithm.m2_threshold: must be > 0 (0 keeps only tokens whose ratio is exactly 1)")
    if a.loss == "icepop" and not 0 < a.icepop_low < 1 < a.icepop_high:
        raise UserError(f"algorithm.icepop_low/icepop_high: the window [{a.icepop_low:g}, {a.icepop_high:g}] must "
                        "hold 1 strictly inside (0 < icepop_low < 1 < icepop_high)")
    if 0 < a.dual_clip <= 1:
        raise UserError(f"algorithm.dual_clip: {a.dual_clip} must be 0 (off) or > 1")
    if a.loss == "mis" and a.is_cap <= 1:
        raise UserError(f"algorithm.is_cap: {a.is_cap:g} with algorithm.loss=mis keeps only weights of exactly 1 "
                        "(the window is [1/cap, cap]): any engine/trainer difference masks every token; use a cap > 1")
    if "algorithm.kl_estimator" in explicit and a.kl_coef == 0:
        raise UserError("algorithm.kl_estimator: not used while algorithm.kl_coef is 0 (no KL term); set kl_coef > 0")
    if a.distill is not None:
        _validate_distill(cfg, explicit)
    if a.norm_length is not None and a.agg != "dr_grpo":
        raise UserError(f"algorithm.norm_length: only used with algorithm.agg=dr_grpo (agg is {a.agg})")
    if "algorithm.overlong_penalty" in explicit and a.overlong_buffer == 0:
        raise UserError("algorithm.overlong_penalty: not used while algorithm.overlong_buffer is 0; set a buffer")
    if a.overlong_buffer >= max_generated_tokens(cfg):
        raise UserError(
            f"algorithm.overlong_buffer: {a.overlong_buffer} must be below the response length limit "
            f"({max_generated_tokens(cfg)} tokens)"
        )
    if (cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0) and a.loss != "reinforce":
        key = "rollout.top_p" if cfg.rollout.top_p < 1.0 else "rollout.top_k"
        raise UserError(
            f"{key}: truncated sampling with algorithm.loss={a.loss} is refused: the behavior log-probs would be "
            "those of the truncated distribution, which the loss's importance ratios cannot use; use top_p=1 and "
            "top_k=0, or algorithm.loss=reinforce with workflow.max_staleness: 0"
        )
    if a.loss == "reinforce" and cfg.staleness > 0:
        raise UserError(f"algorithm.loss: reinforce has no off-policy correction, and workflow.max_staleness="
                        f"{cfg.staleness} trains stale samples; set workflow.max_staleness: 0 or an off-policy loss (ppo)")
    if a.filter_groups and a.advantage == "reinforce_pp":
        raise UserError("algorithm.filter_groups: not used with algorithm.advantage=reinforce_pp (its baseline is the "
                        "batch's: a group of equal rewards still has a non-zero advantage)")
    if cfg.rollout.n == 1 and a.advantage in ("grpo", "dr_grpo", "rloo"):
        raise UserError(f"rollout.n: group advantages (algorithm.advantage={a.advantage}) need n >= 2")
