"""The package's shape: no import cycle among its modules (function-level imports included), and no
module imports another module's private (`_`-prefixed) name. Read from the source with `ast`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import asyncflow

PACKAGE = Path(asyncflow.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The package module `name` lies in (a name imported from a module resolves to the module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The package modules `module` imports anywhere in its source, and the private names it takes
    from other package modules."""
    targets: set[str] = set()
    private: list[str] = []
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                else node.module or ""
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in modules else base)
                if alias.name.startswith("_") and full not in modules and _owner(base, modules) not in (None, module):
                    private.append(f"{module} imports {base}.{alias.name}")
    owners = {_owner(t, modules) for t in targets if t.startswith("asyncflow")}
    return {o for o in owners if o is not None and o != module}, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_and_no_private_name_crosses_a_module() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for name, path in modules.items():
        graph[name], taken = _imports(name, path, modules)
        private += taken
    assert _cycles(graph) == []
    assert private == []


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    """The helpers above find what they look for (so the test above cannot pass by seeing nothing)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from asyncflow.envs.builtin import _private, CalculatorEnv\n")
    deps, taken = _imports("asyncflow.probe", probe, _modules())
    assert deps == {"asyncflow.envs.builtin"} and taken == ["asyncflow.probe imports asyncflow.envs.builtin._private"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    modules = _modules()
    graph = {m: _imports(m, p, modules)[0] for m, p in modules.items()}
    assert "asyncflow.tokenizer" in graph["asyncflow.runner"]  # a top-level import
    assert "asyncflow.evaluation" in graph["asyncflow.runner"]  # a function-level one


# (spelled in parts, so that this file is no match of its own)
EXTENSION_PRIVATES = re.compile(r"\._(optimize|publish)\b|in_process" + " = False")


def _private_seams(roots: list[Path]) -> list[str]:
    """Lines that replace the trainer's private steps or fake the store's placement."""
    return [f"{path}:{i}: {line.strip()}" for root in roots for path in sorted(root.rglob("*.py"))
            for i, line in enumerate(path.read_text().splitlines(), 1) if EXTENSION_PRIVATES.search(line)]


def _store_probes(path: Path) -> list[str]:
    """`getattr(<...store...>, name, default)` calls: probing a store for an operation it may lack."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and "store" in ast.unparse(node.args[0])):
            out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_bench_and_tests_extend_the_trainer_through_public_seams() -> None:
    """The PIPE bench and the tests give the trainer a `Learner`, replace `publish` and set
    `collect_ahead`; none overrides a private step or pretends the store is elsewhere."""
    root = PACKAGE.parent
    assert _private_seams([root / "tests", PACKAGE / "bench"]) == []


def test_the_stages_call_the_store_protocol_without_probing_it() -> None:
    assert [p for path in sorted(PACKAGE.rglob("*.py")) for p in _store_probes(path)] == []


def test_the_seam_checks_see_what_they_look_for(tmp_path: Path) -> None:
    private = ["pipeline._" + "optimize = f", "x = pipeline._" + "publish", "store.in_process" + " = False"]
    (tmp_path / "t.py").write_text("\n".join([*private, "pipeline.learner = f", "pipeline.publish = f"]))
    assert [line.split(": ", 1)[1] for line in _private_seams([tmp_path])] == private
    (tmp_path / "p.py").write_text("ask = getattr(self.store, 'metrics_async', None)\nm = getattr(store.handle, name)\n")
    assert len(_store_probes(tmp_path / "p.py")) == 1


WORKFLOW = PACKAGE / "workflow"
WIRING = {"settings.py", "build.py"}  # the config is read in settings.py; build.py hands it to `from_config`


def _workflow_classes() -> dict[str, tuple[Path, ast.ClassDef]]:
    return {node.name: (path, node) for path in sorted(WORKFLOW.glob("*.py"))
            for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}


def _own_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines for itself: its methods and properties, class-level fields, and every
    `self.X = ...` (or `self.X += ...`) in its body."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def _foreign_reads(path: Path, cls: ast.ClassDef) -> list[str]:
    """`self.X` reads in `cls` of what `cls` does not define itself."""
    own = _own_names(cls)
    return [f"{path.name}:{node.lineno}: {cls.name} reads self.{node.attr}" for node in ast.walk(cls)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and node.attr not in own and not node.attr.startswith("__")]


def _private_reach(path: Path) -> list[str]:
    """`X._name` where X is not `self`/`cls` nor an imported module (`sys._getframe`) and `_name` is not
    defined in this module: another module's private state."""
    tree = ast.parse(path.read_text())
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        defined |= _own_names(cls)
    return [f"{path.name}:{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", *modules))
            and node.attr not in defined]


def _config_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = [f"{path.name}:{n.lineno}: imports {n.module}" for n in ast.walk(tree)
           if isinstance(n, ast.ImportFrom) and n.module in ("asyncflow.config", "asyncflow.config_schema")]
    out += [f"{path.name}:{n.lineno}: imports {a.name}" for n in ast.walk(tree) if isinstance(n, ast.Import)
            for a in n.names if a.name in ("asyncflow.config", "asyncflow.config_schema")]
    out += [f"{path.name}:{n.lineno}: names cfg" for n in ast.walk(tree)
            if (isinstance(n, ast.Name) and n.id == "cfg") or (isinstance(n, ast.arg) and n.arg == "cfg")
            or (isinstance(n, ast.Attribute) and n.attr == "cfg")]
    return out


def test_no_workflow_class_extends_another_workflow_class() -> None:
    """Stages are plain classes built from their parts, not mixins over a shared base."""
    classes = _workflow_classes()
    assert not (WORKFLOW / "stage_base.py").exists()
    bases = [f"{name} extends {ast.unparse(b)}" for name, (_, node) in classes.items() for b in node.bases
             if ast.unparse(b) in classes]
    assert bases == []


def test_a_workflow_class_reads_only_what_it_defines_and_no_module_reaches_into_private_state() -> None:
    """Every `self.X` a workflow class reads it assigns itself (or is its method or property): what
    a class reads is visible in its own body; and no `other._X` of another module's class."""
    assert [r for path, node in _workflow_classes().values() for r in _foreign_reads(path, node)] == []
    assert [r for path in sorted(WORKFLOW.glob("*.py")) for r in _private_reach(path)] == []


def test_the_stage_modules_neither_import_the_config_nor_name_it() -> None:
    uses = [u for path in sorted(WORKFLOW.glob("*.py")) if path.name not in WIRING for u in _config_uses(path)]
    assert uses == []


def test_the_shape_checks_see_what_they_look_for(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from asyncflow.config import Config\n"
                   "class A:\n"
                   "    x: int\n"
                   "    def __init__(self, cfg):\n        self.a = cfg.n\n        self.b = 0\n"
                   "    def f(self, other):\n        self.b += 1\n        other._hidden = self.c\n"
                   "        return self.a + self.x + self.f(other) + self._own()\n"
                   "    def _own(self):\n        return 0\n")
    cls = next(n for n in ast.parse(src.read_text()).body if isinstance(n, ast.ClassDef))
    assert [r.split(": ", 1)[1] for r in _foreign_reads(src, cls)] == ["A reads self.c"]
    assert [r.split(": ", 1)[1] for r in _private_reach(src)] == ["other._hidden"]
    assert [u.split(": ", 1)[1] for u in _config_uses(src)] == ["imports asyncflow.config", "names cfg", "names cfg"]
