"""Config loading, precedence and validation; CLI errors are one line with exit code 2."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncflow.config import field_docs, load_config, parse_set
from asyncflow.errors import UserError


def test_precedence_defaults_task_file_then_set(tmp_path: Path) -> None:
    from asyncflow.config import Config
    from asyncflow.tasks import get_task

    cfg, _ = load_config(None, ["task=arith"])
    task_lr = get_task("arith").defaults["train"]["lr"]
    assert task_lr != Config().train.lr
    assert cfg.train.lr == pytest.approx(task_lr)  # the task pack's lr beats the built-in default
    f = tmp_path / "c.yaml"
    f.write_text("task: arith\ntrain:\n  lr: 0.5\n  max_steps: 7\nrollout: {n: 4}\n")
    cfg, explicit = load_config(f, ["train.lr=0.25"])
    assert cfg.train.lr == 0.25 and cfg.train.max_steps == 7 and cfg.rollout.n == 4
    assert "train.lr" in explicit and "rollout.n" in explicit and "eval.every" not in explicit


_CONTRACT_CONFIG = """\
task: arith
seed: 0
model: {path: null, cache_dir: null}
dataset: {path: data.jsonl, prompt_key: prompt, label_key: answer}
reward: {fn: "my_module:score"}
rollout: {engine: hf, workers: 1, n: 8, max_new_tokens: 16, temperature: 1.0}
train: {engine: torch, batch_size: 64, mini_batches: 1, micro_batch_size: null, lr: null,
        max_steps: 100, max_grad_norm: 1.0}
algorithm: {advantage: grpo, loss: ppo, kl_coef: 0.0}
workflow: {mode: async, max_staleness: 1, weight_update: swap}
eval: {path: null, every: 10, size: 1000, success_threshold: 1.0}
runtime: {kind: local, address: null}
logging: {progress: true, tensorboard: false}
checkpoint: {every: 0, resume: false}
"""


def test_the_contract_config_of_design_md_loads_and_lr_null_means_not_given(tmp_path: Path) -> None:
    """DESIGN.md's config block, as written there (its `lr: null` was refused: train.lr is a number)."""
    from asyncflow.config import Config
    from asyncflow.tasks import get_task

    f = tmp_path / "contract.yaml"
    f.write_text(_CONTRACT_CONFIG)
    cfg, explicit = load_config(f)
    assert cfg.train.lr == pytest.approx(get_task("arith").defaults["train"]["lr"])  # the task pack's
    assert "train.lr" not in explicit and cfg.train.batch_size == 64 and cfg.workflow.max_staleness == 1
    cfg, _ = load_config(f, ["task=null", "model.path=m", "reward.fn=m:f"])
    assert cfg.train.lr == Config().train.lr  # no task pack: the built-in default
    assert load_config(f, ["train.lr=0.5"])[0].train.lr == 0.5  # --set beats the file's null


def test_set_values_are_parsed_as_yaml_scalars() -> None:
    assert parse_set(["a.b=3", "a.c=true", "d=null", "e=x"]) == {"a": {"b": 3, "c": True}, "d": None, "e": "x"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.batchsize=3"], "train.batchsize: unknown key (did you mean 'batch_size'?)"),
        (["trian.lr=3"], "trian: unknown key (did you mean 'train'?)"),
        (["train.lr=fast"], "train.lr: expected a number"),
        (["train.max_steps=1.5"], "train.max_steps: expected an integer"),
        (["rollout.n=0"], "rollout.n: 0 is below the minimum 1"),
        (["workflow.mode=fast"], "workflow.mode: 'fast' is not one of"),
        # messages in the config's language: the value as YAML reads it, and what to do
        (['logging.progress="false"'], "logging.progress: expected true or false, got 'false' (a string: remove the quotes)"),
        (["checkpoint.resume=true"], "checkpoint.resume: true is not one of false, 'auto'"),
        (["dataset.prompt_key=on"], "dataset.prompt_key: expected a string, got true (YAML reads it as a bool: quote it)"),
        (["workflow.mode=sync", "workflow.max_staleness=2"], "workflow.max_staleness: 2 contradicts"),
        (["train.batch_size=12", "rollout.n=8"], "train.batch_size: 12 is not divisible"),
        (["task=null"], "model.path: required when task is null"),
        (["task=nope"], "task: unknown task pack 'nope'"),
        (["reward.fn=mymodule"], "reward.fn: 'mymodule' must be 'module:function' or 'path/to/file.py:function'"),
        (["logging.wandb_project=x"], "logging.wandb_project: not used while logging.wandb is false"),
        (["checkpoint.keep=5"], "checkpoint.keep: not used while checkpoint.every is 0"),
        (["runtime.rollout_cpus=2"], "runtime.rollout_cpus: only used with runtime.kind=ray (kind is local)"),
        (["runtime.max_restarts=1"], "runtime.max_restarts: only used with runtime.kind=ray"),
        (["rollout.env_latency_s=0.1"], "rollout.env_latency_s: only used with rollout.env"),
        (["rollout.env_timeout_s=5"], "rollout.env_timeout_s: only used with rollout.env"),
        (["rollout.max_turns=3"], "rollout.max_turns: only used with rollout.env or rollout.agent"),
        (["rollout.agent_timeout_s=5"], "rollout.agent_timeout_s: only used with rollout.agent"),
        (["algorithm.filter_max_groups_per_step=3"], "algorithm.filter_max_groups_per_step: not used while "
                                                     "algorithm.filter_groups is false"),
        (["rollout.env=calculator", "rollout.agent_timeout_s=5"], "rollout.agent_timeout_s: only used with rollout.agent"),
        (["algorithm.loss=tis", "algorithm.clip_low=0.1"], "algorithm.clip_low: not used by algorithm.loss=tis"),
        (["algorithm.loss=cispo", "algorithm.is_cap=3"], "algorithm.is_cap: not used by algorithm.loss=cispo"),
        (["algorithm.loss=gspo", "algorithm.dual_clip=3"], "algorithm.dual_clip: not used by algorithm.loss=gspo"),
        (["algorithm.loss=reinforce", "workflow.max_staleness=0", "algorithm.is_level=sequence"],
         "algorithm.is_level: not used by"),
        (["algorithm.loss=ppo", "algorithm.is_mode=mask"], "algorithm.is_mode: not used by algorithm.loss=ppo"),
        (["algorithm.loss=reinforce"], "algorithm.loss: reinforce has no off-policy correction, and "
                                       "workflow.max_staleness=1"),
        (["algorithm.filter_groups=true", "algorithm.advantage=reinforce_pp"],
         "algorithm.filter_groups: not used with algorithm.advantage=reinforce_pp"),
        (["algorithm.m2_threshold=0.1"], "algorithm.m2_threshold: not used by algorithm.loss=ppo (used by: m2po)"),
        (["algorithm.loss=m2po", "algorithm.icepop_high=3"], "algorithm.icepop_high: not used by algorithm.loss=m2po"),
        (["algorithm.loss=icepop", "algorithm.is_cap=3"], "algorithm.is_cap: not used by algorithm.loss=icepop"),
        (["algorithm.loss=m2po", "algorithm.m2_threshold=0"], "algorithm.m2_threshold: must be > 0"),
        (["algorithm.loss=icepop", "algorithm.icepop_low=1"], "algorithm.icepop_low/icepop_high: the window [1, 5]"),
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip: 0.5 must be 0 (off) or > 1"),
        (["algorithm.loss=mis", "algorithm.is_cap=1"], "algorithm.is_cap: 1 with algorithm.loss=mis keeps only weights"),
        (["algorithm.is_cap=0.5"], "algorithm.is_cap: 0.5 is below the minimum 1"),
        (["algorithm.kl_estimator=k1"], "algorithm.kl_estimator: not used while algorithm.kl_coef is 0"),
        (["algorithm.norm_length=16"], "algorithm.norm_length: only used with algorithm.agg=dr_grpo"),
        (["algorithm.overlong_penalty=0.5"], "algorithm.overlong_penalty: not used while algorithm.overlong_buffer is 0"),
        (["algorithm.overlong_buffer=6"], "algorithm.overlong_buffer: 6 must be below the response length limit (6 tokens)"),
        (["rollout.top_p=0.9"], "rollout.top_p: truncated sampling with algorithm.loss=ppo is refused"),
        (["rollout.top_k=5", "algorithm.loss=decoupled_ppo"], "rollout.top_k: truncated sampling with algorithm.loss=decoupled_ppo"),
        (["algorithm.loss=nope"], "algorithm.loss: 'nope' is not one of"),
        (["rollout.n=1", "train.batch_size=8", "algorithm.advantage=rloo"], "rollout.n: group advantages"),
        (["train.world_size=2"], "train.world_size: only used with train.engine=fsdp"),
        (["train.worker_timeout_s=5"], "train.worker_timeout_s: only used with train.engine=fsdp"),
        (["train.engine=fsdp", "train.world_size=3", "train.batch_size=16", "rollout.n=4"],
         "train.world_size: batch_size=16 is not divisible by world_size x mini_batches=3 x 1"),
        (["train.engine=fsdp", "train.world_size=2", "train.mini_batches=3", "train.batch_size=16", "rollout.n=4"],
         "train.world_size: batch_size=16 is not divisible by world_size x mini_batches=2 x 3"),
        (["rollout.engine=vllm", "runtime.kind=ray"], "runtime.rollout_gpus: 0 with rollout.engine=vllm on Ray"),
        (["rollout.engine=vllm", "runtime.kind=ray", "runtime.rollout_gpus=0.5"],
         "runtime.rollout_gpus: 0.5 with rollout.engine=vllm on Ray"),
        (["train.engine=deepspeed"], "train.engine: 'deepspeed' is not one of"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(UserError) as info:
        load_config(None, ["task=arith", *overrides])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_vllm_on_ray_is_taken_with_a_gpu_per_rollout_actor_where_vllm_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    sets = ["rollout.engine=vllm", "runtime.kind=ray", "runtime.rollout_gpus=1"]
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(UserError, match=r"^rollout.engine: vllm is not installed"):
            load_config(None, ["task=arith", *sets])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    cfg, _ = load_config(None, ["task=arith", *sets])
    assert (cfg.rollout.engine, cfg.runtime.kind, cfg.runtime.rollout_gpus) == ("vllm", "ray", 1)


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(UserError, match=r"bad.yaml: line \d+"):
        load_config(f)


def test_algorithm_settings_that_are_used_load() -> None:
    cfg, _ = load_config(None, ["task=arith", "algorithm.loss=decoupled_ppo", "algorithm.is_cap=3", "algorithm.is_level=sequence",
                                "algorithm.dual_clip=3", "algorithm.agg=dr_grpo", "algorithm.norm_length=8"])
    assert (cfg.algorithm.is_cap, cfg.algorithm.is_level, cfg.algorithm.norm_length) == (3.0, "sequence", 8)
    cfg, _ = load_config(None, ["task=arith", "algorithm.loss=reinforce", "workflow.max_staleness=0", "rollout.top_p=0.9", "rollout.top_k=5",
                                "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k2", "algorithm.overlong_buffer=2",
                                "algorithm.overlong_penalty=0.5", "rollout.n=1", "train.batch_size=8",
                                "algorithm.advantage=reinforce_pp"])
    assert (cfg.rollout.top_p, cfg.algorithm.kl_estimator, cfg.algorithm.overlong_buffer) == (0.9, "k2", 2)


def test_clip_defaults_are_per_loss_and_config_yaml_shows_them_resolved() -> None:
    from asyncflow.config import effective_dict

    cfg, _ = load_config(None, ["task=arith", "algorithm.loss=gspo"])  # GSPO's sequence ratio: its paper's ~3e-4 / 4e-4
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (3e-4, 4e-4)
    assert (effective_dict(cfg)["algorithm"]["clip_low"], effective_dict(cfg)["algorithm"]["clip_high"]) == (3e-4, 4e-4)
    cfg, _ = load_config(None, ["task=arith", "algorithm.loss=ppo"])
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (0.2, 0.28)
    cfg, _ = load_config(None, ["task=arith", "algorithm.loss=gspo", "algorithm.clip_high=0.001"])
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (3e-4, 0.001)
    assert "clip_low" not in effective_dict(load_config(None, ["task=arith", "algorithm.loss=tis"])[0])["algorithm"]


def test_topr_reads_is_level_and_reinforce_loads_on_policy() -> None:
    assert load_config(None, ["task=arith", "algorithm.loss=topr", "algorithm.is_level=sequence"])[0].algorithm.is_level == "sequence"
    cfg, _ = load_config(None, ["task=arith", "algorithm.loss=reinforce", "workflow.mode=sync"])
    assert cfg.algorithm.loss == "reinforce"


def test_gspo_aggregates_over_sequences_unless_told_otherwise() -> None:
    assert load_config(None, ["task=arith", "algorithm.loss=gspo"])[0].algorithm.agg == "seq_mean_token_mean"
    assert load_config(None, ["task=arith", "algorithm.loss=gspo", "algorithm.agg=token_mean"])[0].algorithm.agg == "token_mean"
    assert load_config(None, ["task=arith", "algorithm.loss=ppo"])[0].algorithm.agg == "token_mean"


def test_sync_mode_means_staleness_zero() -> None:
    assert load_config(None, ["task=arith", "workflow.mode=sync"])[0].staleness == 0
    assert load_config(None, ["task=arith"])[0].staleness == 1


def test_every_field_has_a_docstring() -> None:
    rows = field_docs()
    assert len(rows) > 40
    assert all(doc for _, _, _, doc in rows), [k for k, _, _, d in rows if not d]


def test_cli_bad_input_is_one_line_exit_2_without_torch(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  tempreature: 0.5\n")
    code = "import sys; from asyncflow.cli import main; rc = main(sys.argv[1:]); print('torch' in sys.modules); sys.exit(rc)"
    proc = subprocess.run([sys.executable, "-c", code, "train", str(f)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "asyncflow: error: rollout.tempreature: unknown key (did you mean 'temperature'?)"
    assert proc.stdout.strip() == "False"  # validated before importing torch
    proc = subprocess.run([sys.executable, "-m", "asyncflow", "bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_configuration_reference_in_docs_is_up_to_date() -> None:
    from asyncflow.config import reference_markdown

    doc = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    assert doc.read_text() == reference_markdown(), "regenerate docs/configuration.md (command at its top)"


def test_the_reference_lists_every_task_packs_defaults() -> None:
    from asyncflow.tasks import TASK_NAMES, get_task

    doc = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    packs = doc.split("\n## Task packs\n", 1)[1].split("\n### ")[1:]
    assert [part.split("\n", 1)[0] for part in packs] == list(TASK_NAMES)
    for name, part in zip(TASK_NAMES, packs, strict=True):
        rows = dict(re.findall(r"^\| `([\w.]+)` \| `(.*)` \|$", part, flags=re.M))
        flat = {f"{section}.{key}": value for section, keys in get_task(name).defaults.items()
                for key, value in keys.items()}
        assert rows.keys() == flat.keys(), name
        for key, value in flat.items():
            assert _table_value(rows[key]) == value, (name, key)


def _table_value(text: str) -> object:
    """A value as the reference's tables write it: a Python literal, or YAML's true / false / null."""
    try:
        return ast.literal_eval(text)
    except ValueError:
        return yaml.safe_load(text)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["bench", "store", "--set", "placements=gpu"], "unknown placement"),
        (["bench", "store", "--set", "bogus=1"], "expected one of"),
        (["bench", "pipeline", "--set", "devices=0"], "devices"),
    ],
)
def test_bench_arguments_fail_with_one_line_and_exit_2(args: list[str], needle: str, capsys) -> None:
    from asyncflow.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_fsdp_settings_that_fit_load() -> None:
    cfg, _ = load_config(None, ["task=arith", "train.engine=fsdp", "train.world_size=2", "train.batch_size=16", "rollout.n=4",
                                "train.mini_batches=2", "train.worker_timeout_s=30"])
    assert (cfg.train.engine, cfg.train.world_size, cfg.train.worker_timeout_s) == ("fsdp", 2, 30.0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_rollout_engine_is_refused_when_vllm_is_not_installed() -> None:
    with pytest.raises(UserError, match="rollout.engine: vllm is not installed") as info:
        load_config(None, ["task=arith", "rollout.engine=vllm"])
    assert "\n" not in str(info.value)


def test_yaml_merge_keys_load_and_a_home_path_is_expanded(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("task: arith\ntrain: {<<: {batch_size: 16, max_steps: 3}, max_steps: 1}\ndataset: {path: ~/data.jsonl}\n")
    cfg, _ = load_config(f)
    assert (cfg.train.batch_size, cfg.train.max_steps) == (16, 1)  # a merged key may be overridden beside it
    assert cfg.dataset.path == str(Path.home() / "data.jsonl")


def test_colocation_defaults_to_a_ray_the_run_starts_with_cpu_engines() -> None:
    """`runtime.colocate: null` is true only where the run starts its own Ray (one machine) and the
    rollout actors get no GPU; an explicit value always wins; the resolved config says which."""
    from asyncflow.config_effective import resolve_defaults
    from asyncflow.config_schema import colocated

    def cfg(*extra: str):
        return load_config(None, ["task=arith", "runtime.kind=ray", *extra])[0]

    assert colocated(cfg()) is True
    assert colocated(cfg("runtime.address=auto")) is False  # a joined cluster: restartable actors
    assert colocated(cfg("runtime.rollout_gpus=1")) is False  # GPU engines: cores are not the limit
    assert colocated(cfg("runtime.address=auto", "runtime.colocate=true")) is True
    assert colocated(cfg("runtime.colocate=false")) is False
    assert resolve_defaults(cfg()).runtime.colocate is True
    assert resolve_defaults(load_config(None, ["task=arith"])[0]).runtime.colocate is None  # (local: no Ray actors)
