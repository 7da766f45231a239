"""The `asyncflow` command: demo, train, prepare, bench, report.

Arguments and configs are validated before torch, transformers or ray are imported, so bad input
costs milliseconds and ends with one line naming the key, file or argument, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from asyncflow.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message}")


def _default_out(prefix: str) -> Path:
    return Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="asyncflow", description="Asynchronous, streaming RL post-training for LLMs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="train the built-in arith task with async GRPO on this machine")
    demo.add_argument("--out", type=Path, default=None, help="run folder (default runs/demo-TIMESTAMP)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")

    train = sub.add_parser("train", help="train from a YAML config")
    train.add_argument("config", type=Path, help="YAML config file")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    train.add_argument("--out", type=Path, default=None, help="run folder (default runs/train-TIMESTAMP)")

    prep = sub.add_parser("prepare", help="build a task's base model and data as a Hugging Face folder")
    prep.add_argument("task", help="task pack name, e.g. arith")
    prep.add_argument("--out", type=Path, required=True, help="output folder")
    prep.add_argument("--seed", type=int, default=0)

    bench = sub.add_parser("bench", help="run a benchmark workload")
    bench.add_argument("workload", choices=["store", "pipeline", "e2e"])
    bench.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    bench.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (e2e)")
    report = sub.add_parser("report", help="draw report.png and summary.md for one or more run folders")
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders (the first gets the files)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = make_parser().parse_args(argv)
        return _dispatch(args)
    except UserError as exc:
        print(f"asyncflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncflow: interrupted", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from asyncflow.config import load_config

    if args.command == "demo":
        cfg, _ = load_config(None, args.set)
        from asyncflow.runner import train

        train(cfg, args.out or _default_out("demo"))
        return 0
    if args.command == "train":
        cfg, _ = load_config(args.config, args.set)
        from asyncflow.runner import train

        train(cfg, args.out or _default_out("train"))
        return 0
    if args.command == "prepare":
        import importlib

        from asyncflow.tasks import TASK_NAMES

        if args.task not in TASK_NAMES:
            raise UserError(f"prepare: unknown task {args.task!r}; known: {', '.join(TASK_NAMES)}")
        if args.out.exists() and any(args.out.iterdir()):
            raise UserError(f"--out: {args.out} exists and is not empty")
        out = importlib.import_module(f"asyncflow.tasks.{args.task}").prepare(args.out, seed=args.seed, log=print)
        print(f"prepared {args.task} in {out}")
        return 0
    if args.command == "bench":
        from asyncflow.bench import run_bench

        return run_bench(args.workload, as_json=args.json, overrides=args.set)
    if args.command == "report":
        from asyncflow.telemetry.report import write_report

        png, md = write_report(args.runs)
        print(f"wrote {png} and {md}")
        return 0
    raise UserError(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
