"""Every third-party module asyncflow imports is a declared dependency, and every module imports.

A module imported but not declared passes on a machine where it happens to be installed and fails
for every user who runs `pip install asyncflow`; these tests fail at collection time in CI instead.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from pathlib import Path

import pytest
import tomllib

import asyncflow

PACKAGE = Path(asyncflow.__file__).parent

# Top-level modules that only optional features import, each with the extra that installs it. The
# code that imports them refuses cleanly without them (a one-line error naming the package).
OPTIONAL = {
    "datasets": "datasets",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "vllm": "vllm",
    "peft": "lora",
    "transfer_queue": "bench",
    "psutil": "bench",
    "tensordict": "bench",
    "omegaconf": "bench",
    "verifiers": "verifiers",
    "openai": "verifiers",
    "openenv": "openenv",
    "pydantic": "openenv",
    "httpx": "openenv",
    "uvicorn": "openenv",
    "websockets": "openenv",
    "tinker": "tinker",
}
# Modules that import an optional package at their top, so they cannot be imported without it
# (`__main__` runs the CLI when imported).
OPTIONAL_MODULES = {"asyncflow.bench.tq_baseline": "bench", "asyncflow.__main__": "(runs the CLI)",
                    "asyncflow.envs.verifiers_harness": "verifiers",
                    **{f"asyncflow.tinker.{m}": "tinker" for m in ("wire", "training", "sampling", "service", "server")}}
# Import names that differ from their distribution's name.
DISTRIBUTION = {"yaml": "pyyaml", "transfer_queue": "transferqueue", "openenv": "openenv-core"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> tuple[set[str], dict[str, set[str]]]:
    """The core requirements and each extra's, as normalised distribution names: read from this
    tree's pyproject.toml (the installed metadata may be another checkout's)."""
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {_normal(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]) for req in reqs}

    extras = {extra: names(reqs) for extra, reqs in project.get("optional-dependencies", {}).items()}
    return names(project["dependencies"]), extras


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level third-party module -> the package files that import it (function-level imports too)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top != "asyncflow" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(PACKAGE.parent)))
    return found


def test_every_third_party_import_is_declared() -> None:
    core, extras = _requirements()
    undeclared = {}
    for module, files in sorted(_third_party_imports().items()):
        if module in OPTIONAL:
            extra = OPTIONAL[module]
            if _normal(DISTRIBUTION.get(module, module)) not in extras.get(extra, set()):
                undeclared[module] = f"optional, but extra [{extra}] does not list it ({sorted(files)[0]})"
            continue
        dist = _normal(DISTRIBUTION.get(module, module))
        if dist not in core:
            undeclared[module] = f"imported by {sorted(files)[0]}, not in pyproject's dependencies"
    assert not undeclared, undeclared


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="asyncflow."))


@pytest.mark.parametrize("name", [m for m in _modules() if m not in OPTIONAL_MODULES])
def test_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_optional_modules_are_real_modules() -> None:
    """The exceptions above name modules that exist (a rename would silently widen them)."""
    assert set(OPTIONAL_MODULES) <= set(_modules())


def test_torch_floor_is_one_whose_weights_only_load_holds() -> None:
    """Below torch 2.6 `torch.load(weights_only=True)` can be made to run code (CVE-2025-32434), and
    checkpoints are loaded with it: the declared floor must exclude those versions."""
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    torch_req = next(r for r in project["dependencies"] if re.match(r"torch\b", r))
    floor = re.search(r">=\s*([0-9.]+)", torch_req)
    assert floor is not None, torch_req
    assert tuple(int(x) for x in floor.group(1).split(".")[:2]) >= (2, 6), torch_req
