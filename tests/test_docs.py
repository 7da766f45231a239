"""The docs are checked against the code, fast and offline. In README.md, docs/*.md and any README
under examples/: every relative link and heading anchor resolves (GitHub's slugs); every
`FILE.md, "Heading"` citation names a heading of FILE; every repository path named exists; every
`asyncflow ...` command, in a fenced block or a code span, parses with the CLI's own argument parser,
and a `demo`, `train` or `config` command whose YAML is in the repository resolves it and its `--set`s
through the real config loader (the `--set`s alone, with key, type and bound checks, when its YAML is
a placeholder); a command followed by the `asyncflow: error: ...` line it prints must fail with
exactly that line; every backticked config key exists, a `key: value` one with a value the key
takes; every YAML block that is a config builds. The commands in the comments of examples/**/*.yaml
are checked the same way, and every example loads.

An optional package that is not installed here (vllm, peft, ...) is a warning, not a failure: the
check that needs it is taken as passed and the rest of the config is still checked.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import re
import shlex
import unicodedata
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock
from urllib.parse import unquote

import pytest
import yaml

from asyncflow.cli import DEMO_CONFIG, make_parser
from asyncflow.config import from_dict, load_config, parse_set
from asyncflow.config_hints import alias_hint, schema_keys
from asyncflow.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("README*.md"))]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
KEYS = schema_keys()
SECTIONS = {k.split(".")[0] for k in KEYS if "." in k}
TOP_LEVEL = {k.split(".")[0] for k in KEYS}
OPTIONAL_PACKAGES = ("vllm", "sglang", "peft", "tensorboard", "wandb")
# What the docs' commands write for a number (`--set seed=SEED`); a fenced block may declare its own
# placeholders in a comment, `# K in 8 16; LOSS in ppo tis`, and each value is then checked in turn.
PLACEHOLDERS = {"SEED": ["0", "1", "2"], "N": ["1"], "S": ["0"], "PORT": ["8000"]}
# Backticked dotted names that begin like a config key but are not one: a transformers method.
NOT_KEYS = {"model.generate"}
# A value that stands for one (`model.task_seed: N`, `train.min_lr_ratio: r`, `reward.weights: ...`).
PLACEHOLDER_VALUE = r"[a-z]|[A-Z][A-Z_]*|\.\.\."
FILE_SUFFIXES = (".json", ".jsonl", ".safetensors", ".parquet", ".yaml", ".py", ".md", ".png", ".bin", ".gguf")
REPO_PATH = re.compile(r"(?<![\w./~$-])((?:\.ci|asyncflow|docs|examples|scripts|tests)/[\w./*-]*[\w*])")
CITATION = re.compile(r"([\w./-]+\.md|README)`?\)?(?:,\s*|\s+\()(?:section\s+)?\"([^\"]+)\"")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
COMMAND_LANGS = {"", "bash", "sh", "shell", "console", "text"}


@dataclass
class Findings:
    """What a check found: problems (the test fails on them) and the optional packages it had to
    take as installed (the test warns about them)."""

    problems: list[str] = field(default_factory=list)
    assumed: set[str] = field(default_factory=set)


@dataclass
class Block:
    line: int  # the line number of its first line
    lang: str
    lines: list[str]


@dataclass
class Markdown:
    """A markdown file split into its prose (fenced lines blanked, so offsets keep line numbers) and
    its fenced blocks."""

    path: Path
    text: str
    prose: str
    blocks: list[Block]

    @classmethod
    def read(cls, path: Path) -> Markdown:
        prose: list[str] = []
        blocks: list[Block] = []
        fence: str | None = None
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            opening = re.match(r"\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
            if fence is None and opening:
                fence = opening.group(1)
                blocks.append(Block(number + 1, opening.group(2).lower(), []))
                line = ""
            elif fence is not None:
                if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                    fence = None
                else:
                    blocks[-1].lines.append(line)
                line = ""
            prose.append(line)
        return cls(path, text, "\n".join(prose), blocks)

    def line_of(self, offset: int) -> int:
        return self.prose.count("\n", 0, offset) + 1

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix() if self.path.is_relative_to(ROOT) else str(self.path)

    def where(self, offset: int) -> str:
        return f"{self.name}:{self.line_of(offset)}"

    def without_code_spans(self) -> str:
        """The prose with each code span blanked (same length: offsets keep their lines)."""
        return SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), self.prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (a link's text, no HTML tags) lowercased, punctuation
    and symbols other than - and _ removed, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    kept = "".join(c for c in text.lower() if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def headings(doc: Markdown) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", doc.prose, re.MULTILINE)]


def anchors(doc: Markdown) -> set[str]:
    """Every heading's anchor (a repeated one gets -1, -2, ... as GitHub numbers them) and every
    `<a id="...">`."""
    seen: dict[str, int] = {}
    for text in headings(doc):
        base = result = slug(text)
        while result in seen:
            seen[base] += 1
            result = f"{base}-{seen[base]}"
        seen[result] = 0
    return set(seen) | set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", doc.prose))


def check_links(doc: Markdown, found: Findings) -> None:
    """Relative links and images name existing files; an anchor names a heading of its target."""
    for m in LINK.finditer(doc.without_code_spans()):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_text, _, anchor = target.partition("#")
        path = (doc.path.parent / unquote(path_text)).resolve() if path_text else doc.path
        if not path.exists():
            found.problems.append(f"{doc.where(m.start())}: link to {target}: {path_text} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in anchors(Markdown.read(path)):
            found.problems.append(f"{doc.where(m.start())}: link to {target}: no heading #{anchor} in {path.name}")
        elif anchor and path.suffix != ".md" and not re.fullmatch(r"L\d+(-L\d+)?", anchor):
            found.problems.append(f"{doc.where(m.start())}: link to {target}: an anchor into a file that has no headings")


def titles(doc: Markdown) -> list[str]:
    """The headings, and the bold titles that paragraphs start with (`**Steps that are not taken.**`)."""
    return headings(doc) + re.findall(r"^\*\*([^*\n]+?)\.?\*\*", doc.prose, re.MULTILINE)


def check_citations(doc: Markdown, found: Findings) -> None:
    """`docs/x.md, "Title"` and `README ("Title")` name a heading (or a paragraph's bold title) that
    starts with that text."""
    for m in CITATION.finditer(doc.prose):
        name, quoted = m.group(1), " ".join(m.group(2).replace("`", "").split())
        candidates = [ROOT / "README.md"] if name == "README" else [doc.path.parent / name, ROOT / name]
        target = next((p for p in candidates if p.is_file()), None)
        if target is None:
            found.problems.append(f"{doc.where(m.start())}: cites {name}, which does not exist")
        elif not any(h.replace("`", "").startswith(quoted) for h in titles(Markdown.read(target))):
            found.problems.append(f"{doc.where(m.start())}: cites {name}, \"{quoted}\": no such heading or title there")


def check_paths(doc: Markdown, found: Findings) -> None:
    """Every repository path named, in prose or code blocks (`tests/test_x.py`, `examples/*.yaml`, a
    glob), exists; a link to another site names that site's paths."""
    text = re.sub(r"\[[^\]]*\]\(https?://[^)]*\)", lambda m: re.sub(r"[^\n]", " ", m.group()), doc.text)
    for m in REPO_PATH.finditer(text):
        name = m.group(1)
        if not (any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()):
            line = text.count("\n", 0, m.start()) + 1
            found.problems.append(f"{doc.name}:{line}: {name} is not in the repository")


def check_keys(doc: Markdown, found: Findings) -> None:
    """A backticked `section.key` is a config key (or a TRL or verl name the loader answers with
    its asyncflow key); `section.key: value` and `section.key=value` give a value the key takes."""
    for m in SPAN.finditer(doc.prose):
        for part in split_settings(m.group(2).strip()):  # `a.b: 1, c.d: 2`
            problem = key_problem(part)
            if problem is not None:
                found.problems.append(f"{doc.where(m.start())}: `{part}`: {problem}")


def split_settings(span: str) -> list[str]:
    """`a.b: 1, c=2` -> its settings; a ", " inside braces or brackets (`{r: 16, alpha: 32}`) stays."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(span):
        depth += (ch in "{[(") - (ch in "}])")
        if depth == 0 and span.startswith(", ", i) and re.match(r"[a-z_.]+(?:=|: )", span[i + 2:]):
            parts.append(span[start:i])
            start = i + 2
    return [*parts, span[start:]]


def key_problem(span: str) -> str | None:
    km = re.match(r"([a-z_]+(?:\.[a-z_0-9]+)+)(.*)", span, re.DOTALL)
    if km is None or km.group(1).split(".")[0] not in SECTIONS:
        return None
    key, rest = km.groups()
    if key in NOT_KEYS or key.endswith(FILE_SUFFIXES):
        return None
    if key not in KEYS and not any(k.startswith(f"{key}.") for k in KEYS):
        known_alias = (alias_hint(key, None) or "").startswith("; ")
        return None if known_alias else f"{key} is not a config key"
    value = re.fullmatch(r"(?:: |=)(\S.*)", rest, re.DOTALL)
    if value is None or key not in KEYS or re.fullmatch(PLACEHOLDER_VALUE, value.group(1)):
        return None
    try:
        from_dict(parse_set([f"{key}={value.group(1)}"]))
    except UserError as exc:
        return str(exc)
    return None


def check_yaml_blocks(doc: Markdown, found: Findings) -> None:
    """A YAML block whose top level names a config section builds as a config (keys, types, bounds)."""
    for block in doc.blocks:
        if block.lang not in ("yaml", "yml"):
            continue
        try:
            data = yaml.safe_load("\n".join(block.lines))
        except yaml.YAMLError as exc:
            found.problems.append(f"{doc.name}:{block.line}: a YAML block YAML cannot read: {exc}")
            continue
        if isinstance(data, dict) and set(data) & TOP_LEVEL:
            try:
                from_dict(data)
            except UserError as exc:
                found.problems.append(f"{doc.name}:{block.line}: a config block: {exc}")


@contextlib.contextmanager
def optional_packages_assumed(assumed: set[str]) -> Iterator[None]:
    """`importlib.util.find_spec`, but an optional package that is not installed is found, and noted:
    the config checks that need it pass, and the others are still made."""
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
        spec = real(name, package)
        if spec is None and name in OPTIONAL_PACKAGES:
            assumed.add(name)
            return importlib.machinery.ModuleSpec(name, None)
        return spec

    with mock.patch.object(importlib.util, "find_spec", find_spec):
        yield


@dataclass
class Command:
    where: str
    text: str
    inline: bool = False  # a code span: naming a command without its required arguments is fine
    expected_error: str | None = None  # the `asyncflow: error: ...` line shown after it
    domains: dict[str, list[str]] = field(default_factory=lambda: dict(PLACEHOLDERS))


def fenced_commands(doc: Markdown) -> Iterator[Command]:
    """The `asyncflow ...` commands of the shell blocks, continuation lines joined, each with the error
    line shown after it and the placeholders its block declares (`# K in 8 16; LOSS in ppo tis`)."""
    for block in doc.blocks:
        if block.lang not in COMMAND_LANGS:
            continue
        domains = dict(PLACEHOLDERS)
        for declared in re.findall(r"#.*", "\n".join(block.lines)):
            domains.update({k: v.split() for k, v in re.findall(r"\b([A-Z][A-Z_]*) in ((?:[\w.-]+ ?)+)", declared)})
        found: list[Command] = []
        start, joined = 0, ""
        for offset, line in enumerate(block.lines):
            start, joined = (start if joined else offset), f"{joined} {line.strip()}".strip()
            if joined.endswith("\\"):  # a continuation line
                joined = joined[:-1]
                continue
            joined, line = "", joined.removeprefix("$ ")
            if line.startswith("asyncflow: error: ") and found:
                found[-1].expected_error = line.removeprefix("asyncflow: error: ")
            elif re.search(r"(^|&&|;)\s*asyncflow\s", f"{line} "):
                found.append(Command(f"{doc.name}:{block.line + start}", line, domains=domains))
        yield from found


def inline_commands(doc: Markdown) -> Iterator[Command]:
    for m in SPAN.finditer(doc.prose):
        if m.group(2).strip().startswith("asyncflow "):
            yield Command(doc.where(m.start()), " ".join(m.group(2).split()), inline=True)


def fill(word: str, values: dict[str, str]) -> str:
    """`word` with each placeholder that `values` names replaced by its value."""
    return re.sub(r"\b[A-Z][A-Z_]*\b", lambda m: values.get(m.group(), m.group()), word)


def variants(argv: list[str], domains: dict[str, list[str]]) -> list[list[str]]:
    """The command with its placeholders filled and each `a|b` alternative taken: every value of each
    in turn, the others at their first value."""
    first = {k: v[0] for k, v in domains.items()}
    picks = [first, *({**first, k: value} for k, values in domains.items() for value in values[1:])]
    out: list[list[str]] = []
    for pick in picks:
        words = [fill(w, pick) for w in argv]
        firsts = [re.sub(r"[^=|]*(\|[^|]*)+$", lambda m: m.group().split("|")[0], w) for w in words]
        out.append(firsts)
        for i, word in enumerate(words):
            head, sep, tail = word.rpartition("=") if "=" in word else ("", "", word)
            for alternative in tail.split("|")[1:] if "|" in tail else []:
                out.append([*firsts[:i], f"{head}{sep}{alternative}", *firsts[i + 1:]])
    return [list(v) for v in dict.fromkeys(map(tuple, out))]


def check_command(command: Command, found: Findings) -> None:
    """Parse it (a synopsis, `[--out DIR]`, with its brackets dropped), then resolve each variant
    (a synopsis, or a code span that only names the command, is parsed only)."""
    try:
        words = shlex.split(command.text, comments=True)
    except ValueError as exc:
        found.problems.append(f"{command.where}: `{command.text}`: the shell cannot split it: {exc}")
        return
    segments: list[list[str]] = [[]]  # (the shell's `a && b; c &` run each)
    for word in words:
        segments.append([]) if word in ("&&", "||", ";", "&", "|") else segments[-1].append(word)
    for segment in segments:
        if segment[:1] == ["asyncflow"]:
            synopsis = any(w.startswith("[") for w in segment)
            argv = [w.removeprefix("[") for w in segment[1:]]
            argv = [w.removesuffix("]" if "[" not in w else "") for w in argv]
            argv = [w for w in argv if w not in ("...", "")]
            named_only = command.inline and len(argv) <= 1  # `asyncflow config` names the command
            for variant in variants(argv, command.domains):
                resolve_command(command, variant, not (synopsis or named_only), found)


def resolve_command(command: Command, argv: list[str], resolve: bool, found: Findings) -> None:
    """Parse with the CLI's parser; `demo`, `train` and `config` resolve their YAML and `--set`s."""
    shown = f"`asyncflow {shlex.join(argv)}`"
    try:
        args = make_parser().parse_args(argv)
    except UserError as exc:
        if not (command.inline and "arguments are required" in str(exc)):
            found.problems.append(f"{command.where}: {shown}: {exc}")
        return
    except SystemExit as exc:  # --help or --version: nothing to resolve
        if exc.code:
            found.problems.append(f"{command.where}: {shown}: exit {exc.code}")
        return
    if not resolve or args.command not in ("demo", "train", "config"):
        if command.expected_error is not None:
            found.problems.append(f"{command.where}: {shown}: only a config's error can be checked here")
        return
    path = DEMO_CONFIG if args.command == "demo" else args.config
    path = path if path is None or path.is_absolute() else ROOT / path
    try:
        with optional_packages_assumed(found.assumed):
            if path is None or path.is_file():
                load_config(path, args.set)
            else:  # a placeholder YAML (`my.yaml`): the --set keys, types and bounds alone
                from_dict(parse_set(args.set))
    except UserError as exc:
        if str(exc) != command.expected_error:
            found.problems.append(f"{command.where}: {shown}: {exc}")
        return
    if command.expected_error is not None:
        found.problems.append(f"{command.where}: {shown}: no error, the doc shows {command.expected_error!r}")


def check_doc(path: Path) -> Findings:
    doc = Markdown.read(path)
    found = Findings()
    for check in (check_links, check_citations, check_paths, check_keys, check_yaml_blocks):
        check(doc, found)
    for command in [*fenced_commands(doc), *inline_commands(doc)]:
        check_command(command, found)
    return found


def check_example(path: Path) -> Findings:
    """The commands in an example's comments are checked; the example loads as they run it (or as is)."""
    found = Findings()
    name = path.relative_to(ROOT).as_posix()
    commands = [Command(f"{name}:{n}", line.lstrip("# ").strip())
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if re.match(r"#\s+asyncflow\s", line)]
    for command in commands:
        check_command(command, found)
    if not any(re.match(rf"asyncflow (train|config) {re.escape(name)}\b", c.text) for c in commands):
        try:
            with optional_packages_assumed(found.assumed):
                load_config(path)
        except UserError as exc:
            found.problems.append(f"{name}: {exc}")
    return found


def report(found: Findings, what: str) -> None:
    if found.assumed:
        warnings.warn(f"{what}: {', '.join(sorted(found.assumed))} not installed here; the config checks "
                      "that need it were taken as passed", UserWarning, stacklevel=2)
    assert not found.problems, "\n".join(found.problems)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_doc_has_no_broken_link_citation_path_command_or_key(path: Path) -> None:
    report(check_doc(path), path.relative_to(ROOT).as_posix())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_an_example_loads_as_its_comments_run_it(path: Path) -> None:
    report(check_example(path), path.relative_to(ROOT).as_posix())


def test_slugs_follow_githubs_rules(tmp_path: Path) -> None:
    assert slug("Train engine `fsdp` (FSDP2)") == "train-engine-fsdp-fsdp2"
    assert slug("E2E: sync vs async — `asyncflow bench e2e --json`") == "e2e-sync-vs-async--asyncflow-bench-e2e---json"
    assert slug("[Links](x.md) keep_their text, 3.5×") == "links-keep_their-text-35"
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n## Part\n```\n## not a heading\n```\n## Part\n## Part\n<a id=\"own\"></a>\n")
    assert anchors(Markdown.read(doc)) == {"top", "part", "part-1", "part-2", "own"}


def test_the_checker_reports_each_planted_mistake_and_nothing_else(tmp_path: Path) -> None:
    """One broken and one sound instance of each thing the docs test checks: exactly the broken
    lines are reported (so a doc with such a mistake fails the suite)."""
    with pytest.raises(UserError) as refused:
        load_config(None, ["algorithm.beta=0.04"])
    beta_error = str(refused.value)
    (tmp_path / "other.md").write_text("# Other\n## A heading\n## A heading\n\n**A bold title.** Text.\n")
    lines = {
        "[sound](other.md#a-heading-1), [an image](other.md), [a site](https://example.com/x#y)": None,
        "[broken](missing.md)": "missing.md does not exist",
        "[broken anchor](other.md#no-such-heading)": "no heading #no-such-heading",
        'cited: other.md, "A heading"; and other.md, "A bold title"': None,
        'cited: other.md, "Not there"': '"Not there": no such heading',
        "`tests/test_docs.py`, tests/test_doc*.py": None,
        "`tests/test_no_such_file.py`": "tests/test_no_such_file.py is not in the repository",
        "`train.lr`, `model.lora.r`, `workflow.mode: sync`, `model.task_seed: N`, `algorithm.adv_estimator`": None,
        "`train.lrr`": "train.lrr is not a config key",
        "`algorithm.loss: decoupled_pp`": "algorithm.loss: 'decoupled_pp' is not one of",
        "`asyncflow train examples/arith_async.yaml --set train.lr=1e-5`, `asyncflow serve`, `asyncflow demo`": None,
        "`asyncflow train examples/arith_async.yaml --set workflow.mode=sync`": "contradicts workflow.mode=sync",
        "`asyncflow demo --outt runs/x`": "unrecognized arguments: --outt",
    }
    block = {
        "asyncflow train my.yaml --set seed=SEED --out runs/x-sSEED &   # a comment": None,
        "asyncflow train examples/arith_async.yaml \\\n  --set train.lrr=1": "train.lrr: unknown key",
        "asyncflow train my.yaml --set rollout.n=zero": "rollout.n: expected an integer",
        "asyncflow serve asyncflow/no_such_model --port 8000 &": "asyncflow/no_such_model is not in the repository",
        "asyncflow train examples/arith_async.yaml --set workflow.mode=sync|async": "contradicts workflow.mode=sync",
        f"$ asyncflow config --set algorithm.beta=0.04\nasyncflow: error: {beta_error}": None,
        "$ asyncflow config --set algorithm.beta=0.04\nasyncflow: error: another message": beta_error,
    }
    text = "# Planted\n\n" + "\n\n".join(lines) + "\n\n```bash\n" + "\n".join(block) + "\n```\n"
    text += "\n```yaml\ntrain: {batch_size: many}\n```\n\n```yaml\nrollout: {n: 4}\n```\n"
    (tmp_path / "doc.md").write_text(text)
    found = check_doc(tmp_path / "doc.md")

    expected = {**lines, **block, "train: {batch_size: many}": "train.batch_size: expected an integer"}
    for snippet, problem in expected.items():
        line = text[:text.index(snippet)].count("\n") + 1
        here = [p for p in found.problems if p.startswith(f"{tmp_path / 'doc.md'}:{line}:")]
        assert (problem is None and not here) or (problem is not None and any(problem in p for p in here)), \
            (snippet, here)
    assert len(found.problems) == sum(p is not None for p in expected.values()), found.problems


def test_the_demo_help_names_the_task_the_demo_trains(capsys: pytest.CaptureFixture[str]) -> None:
    cfg, _ = load_config(DEMO_CONFIG)
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    demo_line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("demo "))
    assert f"the built-in {cfg.task} task" in demo_line
