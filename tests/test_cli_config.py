"""`asyncflow config`, `--version`, one error prefix, and the run folder's config.yaml: effective
values that load back as the same config."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import asyncflow
from asyncflow import checkpoint
from asyncflow.cli import main
from asyncflow.config import dump_yaml, field_docs, load_config, to_dict, value_notes
from asyncflow.config_schema import LORA_LR, torch_threads
from asyncflow.run_folder import RunFolder
from asyncflow.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    (ROOT / "asyncflow" / "demo.yaml", []),
    (None, ["task=arith"]),
    (None, ["task=arith", "workflow.mode=sync"]),
    (None, ["task=arith", "algorithm.agg=dr_grpo", "algorithm.advantage=dr_grpo"]),
    (None, ["task=arith", "algorithm.loss=gspo", "algorithm.agg=token_mean"]),
    (None, ["task=arith", "algorithm.loss=tis", "algorithm.kl_coef=0.01", "runtime.kind=ray", "runtime.rollout_gpus=0.5"]),
    (None, ["task=arith", "rollout.engine=openai", "rollout.server_urls=[http://127.0.0.1:8000, http://127.0.0.1:8001]"]),
    (None, ["task=arith", "train.engine=fsdp", "train.world_size=2", "train.micro_batch_size=8"]),
    (None, ["task=arith", "model.lora.r=8", "model.lora.target_modules=[q_proj, v_proj]"]),
    *[(p, []) for p in sorted((ROOT / "examples").glob("arith*.yaml"))],
    (ROOT / "examples" / "byo" / "config.yaml", ["model.path=/nonexistent"]),
    (ROOT / "examples" / "byo" / "config.yaml", ["model.path=/nonexistent", "model.lora.r=8", "train.lr=null"]),
    (ROOT / "examples" / "calc_agent.yaml", []),
]


@pytest.mark.parametrize(("path", "overrides"), CONFIGS)
def test_the_resolved_config_loads_back_as_the_same_config(path: Path | None, overrides: list[str],
                                                           tmp_path: Path) -> None:
    cfg, _ = load_config(path, overrides)
    text = dump_yaml(cfg)
    (tmp_path / "config.yaml").write_text(text)
    again, _ = load_config(tmp_path / "config.yaml")  # every key now explicit: none may be refused
    assert dump_yaml(again) == text
    data = yaml.safe_load(text)
    assert data["workflow"]["max_staleness"] == cfg.staleness
    assert data["runtime"]["torch_threads"] == torch_threads(cfg)
    if cfg.algorithm.agg == "dr_grpo":
        assert data["algorithm"]["norm_length"] == cfg.rollout.max_new_tokens
    assert again.algorithm.agg == cfg.algorithm.agg and again.rollout.workers == cfg.rollout.workers


def test_effective_values_replace_null_and_unread_keys_are_left_out() -> None:
    data = yaml.safe_load(dump_yaml(load_config(None, ["task=arith"])[0]))
    assert data["workflow"]["max_staleness"] == 1  # async: null meant 1
    assert data["runtime"]["torch_threads"] >= 1
    assert "rollout_gpus" not in data["runtime"] and "server_urls" not in data["rollout"]  # local, hf
    assert "is_level" not in data["algorithm"] and "world_size" not in data["train"]  # ppo, torch
    data = yaml.safe_load(dump_yaml(load_config(None, ["task=arith", "workflow.mode=sync", "runtime.kind=ray"])[0]))
    assert data["workflow"]["max_staleness"] == 0 and data["runtime"]["rollout_gpus"] == 0.0


def test_a_run_folder_records_the_effective_config(tmp_path: Path) -> None:
    cfg, _ = load_config(None, ["task=arith"])
    folder = RunFolder(tmp_path / "run", cfg, None)
    try:
        folder.open()
    finally:
        folder.close()
    assert (tmp_path / "run" / "config.yaml").read_text() == dump_yaml(cfg)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["workflow"]["max_staleness"] == 1


def test_a_run_recorded_with_nulls_and_every_key_resumes_unchanged(tmp_path: Path) -> None:
    """Runs written before config.yaml held effective values recorded nulls and unread keys; a
    resume compares them as this version writes them, so none reads as a changed setting."""
    cfg, _ = load_config(None, ["task=arith"])  # (rollout.max_turns, a key a resume must keep, is not read here)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert checkpoint._changed_settings(tmp_path, cfg) == []


def test_config_command_prints_the_resolved_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("task: arith\nrollout: {n: 4}\ntrain: {batch_size: 16}\n")
    assert main(["config", str(f), "--set", "workflow.mode=sync"]) == 0
    out = capsys.readouterr().out
    cfg, explicit = load_config(f, ["workflow.mode=sync"])
    assert out == dump_yaml(cfg, value_notes(cfg, explicit))
    assert yaml.safe_load(out) == yaml.safe_load(dump_yaml(cfg))  # the notes are comments only
    assert yaml.safe_load(out)["train"]["batch_size"] == 16
    assert main(["config", "--set", "task=calc"]) == 0 and yaml.safe_load(capsys.readouterr().out)["task"] == "calc"


BYO = "model: {path: my-model}\ndataset: {path: data.jsonl}\nreward: {fn: 'rewards.py:score'}\n"


def test_a_config_without_a_task_gets_no_pack_and_the_documented_defaults(capsys: pytest.CaptureFixture[str],
                                                                          tmp_path: Path) -> None:
    f = tmp_path / "byo.yaml"
    f.write_text(BYO)
    assert main(["config", str(f)]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["task"] is None and "# from task" not in out
    documented = {key: default for key, _, default, _ in field_docs()}
    for key in ("rollout.n", "rollout.max_new_tokens", "rollout.temperature", "train.batch_size", "train.lr",
                "train.max_steps", "eval.every", "eval.size"):
        section, name = key.split(".")
        assert data[section][name] == documented[key], key
    # defaults that suit a real pretrained model: TRL's completion length, TRL's and verl's learning rate
    assert (data["rollout"]["max_new_tokens"], data["train"]["lr"]) == (256, 1e-6)


def test_lora_without_a_rate_gets_its_own_default_and_says_so(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    f = tmp_path / "byo.yaml"
    f.write_text(BYO)
    assert main(["config", str(f), "--set", "model.lora.r=8"]) == 0
    out = capsys.readouterr().out
    assert "  lr: 1.0e-05  # the default with model.lora\n" in out and yaml.safe_load(out)["train"]["lr"] == LORA_LR
    assert load_config(f, ["model.lora.r=8", "train.lr=3e-6"])[0].train.lr == 3e-6  # given: kept
    assert load_config(f, ["model.lora.r=8", "train.lr=null"])[0].train.lr == LORA_LR  # null: as if not given
    task_lr = get_task("arith").defaults["train"]["lr"]
    assert load_config(None, ["task=arith", "model.lora.r=8"])[0].train.lr == task_lr  # the pack's rate wins


def test_a_config_naming_a_pack_marks_each_value_the_pack_set(capsys: pytest.CaptureFixture[str],
                                                              tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("task: arith\ntrain: {max_steps: 7}\n")
    assert main(["config", str(f), "--set", "rollout.n=4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  max_new_tokens: 6  # from task arith" in lines and "  lr: 0.0002  # from task arith" in lines
    assert "  max_steps: 7" in lines and "  n: 4" in lines  # given by the file and --set: not the pack's
    marked = [line for line in lines if line.endswith("  # from task arith")]
    pack = get_task("arith").defaults
    assert len(marked) == sum(len(section) for section in pack.values()) - 2


def test_config_checks_a_config_whose_optional_packages_are_missing_and_warns(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A GPU config looked at on a laptop: every other check runs, each missing package is one warning
    naming its key, and the config is printed as it would be with them; `train` still refuses it."""
    f = tmp_path / "gpu.yaml"
    f.write_text("task: arith\nrollout: {engine: vllm}\nmodel: {device: cuda, lora: {r: 8}}\nlogging: {tensorboard: true}\n")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in ("vllm", "peft") else real(name, *a))
    assert main(["config", str(f)]) == 0
    with_packages = capsys.readouterr().out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("vllm", "peft", "tensorboard")
                        else real(name, *a))
    assert main(["config", str(f)]) == 0
    captured = capsys.readouterr()
    assert captured.out == with_packages  # (the keys a vllm run does not read are left out alike)
    assert captured.err.splitlines() == [
        "asyncflow: warning: model.lora: the peft package is not installed (pip install 'asyncflow[lora]') "
        "(asyncflow train refuses this config until it is installed)",
        "asyncflow: warning: rollout.engine: vllm is not installed (pip install 'asyncflow[vllm]', needs a GPU); "
        "use hf (asyncflow train refuses this config until it is installed)",
        "asyncflow: warning: logging.tensorboard: the tensorboard package is not installed (pip install "
        "tensorboard) (asyncflow train refuses this config until it is installed)",
    ]
    assert main(["config", str(f), "--set", "train.lr=-1"]) == 2  # everything else is still checked
    assert capsys.readouterr().err == "asyncflow: error: train.lr: -1.0 is below the minimum 0.0\n"
    assert main(["train", str(f), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == ("asyncflow: error: model.lora: the peft package is not installed "
                                       "(pip install 'asyncflow[lora]')\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["config", "--set", "algorithm.beta=0.1"],
         "asyncflow: error: algorithm.beta: unknown key; TRL's beta is algorithm.kl_coef\n"),
        (["config", "missing.yaml"], "asyncflow: error: missing.yaml: config file not found\n"),
        # one prefix: argparse's usage errors name the subcommand, not the program again
        ([], "asyncflow: error: the following arguments are required: command\n"),
        (["train"], "asyncflow: error: train: the following arguments are required: config\n"),
        (["prepare", "arith"], "asyncflow: error: prepare: the following arguments are required: --out\n"),
        (["config", "a.yaml", "b.yaml"], "asyncflow: error: unrecognized arguments: b.yaml\n"),
    ],
)
def test_bad_input_is_one_line_with_one_prefix(argv: list[str], line: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == line and captured.out == ""


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("asyncflow ") and out.count("\n") == 1
    try:
        installed = importlib.metadata.version("asyncflow")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert out.split()[1] in {asyncflow.__version__, installed}


def test_train_help_points_to_the_config_reference(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "docs/configuration.md" in text and "asyncflow config CONFIG" in text


@pytest.mark.parametrize("command", ["train", "demo"])
def test_run_help_explains_each_field_of_the_progress_line_in_a_line(command: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    for field in ("samples/s", "reward", "stale", "eval", "in_store", "eta"):  # (what the line prints: test_workflow)
        assert len(lines[field].split()) > 3, field


def test_train_ends_with_the_commands_that_show_its_run(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import shlex

    import asyncflow.runner
    from asyncflow.cli import make_parser

    ran: list[Path] = []
    monkeypatch.setattr(asyncflow.runner, "train", lambda cfg, out, explicit: ran.append(out))  # (the run: elsewhere)
    out = tmp_path / "my run"
    assert main(["train", str(ROOT / "examples" / "arith_async.yaml"), "--out", str(out)]) == 0
    assert ran == [out]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[asyncflow] charts and summary: asyncflow report '{out}'",
                     f"[asyncflow] stages and workers over time: asyncflow trace '{out}'"]
    for line in lines:  # each is a command asyncflow takes, naming this run's folder
        argv = shlex.split(line.split(": ", 1)[1])[1:]
        args = make_parser().parse_args(argv)
        assert (args.command, getattr(args, "runs", [getattr(args, "run", None)])) in [("report", [out]), ("trace", [out])]


def test_the_config_command_loads_nothing_heavy() -> None:
    code = ("import sys; from asyncflow.cli import main; main(['config', '--set', 'task=arith']); "
            "assert not {'torch', 'transformers', 'ray'} & set(sys.modules), sorted(sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr


def test_the_verl_translation_loads_with_verls_numbers_in_asyncflows_units() -> None:
    extra = [] if importlib.util.find_spec("vllm") is not None else ["rollout.engine=hf"]  # (vllm: checked installed)
    cfg, _ = load_config(ROOT / "examples" / "verl_grpo.yaml", extra)
    prompts, n, ppo_mini_batch_size = 1024, 5, 256  # verl's data.train_batch_size, rollout.n, ppo_mini_batch_size
    assert cfg.rollout.n == n and cfg.train.batch_size == prompts * n
    assert cfg.train.mini_batches == prompts // ppo_mini_batch_size
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high, cfg.algorithm.dual_clip) == (0.2, 0.2, 3.0)
    assert cfg.algorithm.kl_coef == 0.001 and cfg.staleness == 0
    assert cfg.dataset.path is not None and not cfg.dataset.path.startswith("~")


def test_the_verl_gsm8k_reward_scores_as_verl_does() -> None:
    from examples.verl_gsm8k_reward import extract_answer, gsm8k_reward

    assert extract_answer("so 3 + 4 = 7\n#### 1,234") == "1234" and extract_answer("no answer") is None
    rows = [{"ground_truth": "72", "style": "rule"}, {"ground_truth": "10", "style": "rule"}]
    chat = [[{"role": "assistant", "content": "48 + 24 = 72\n#### 72"}], [{"role": "assistant", "content": "#### 9"}]]
    assert gsm8k_reward(["p", "q"], chat, reward_model=rows, data_source=["gsm8k"] * 2) == [1.0, 0.0]
    assert gsm8k_reward(["p"], ["#### $72"], reward_model=rows[:1]) == [1.0]
