"""Importing the code a config names (`module:function` or `path/to/file.py:function`) without
putting any folder on `sys.path`.

A module name is imported as Python imports it: from `sys.path` as the interpreter set it up (the
installed environment and PYTHONPATH; with `python -m asyncflow`, also the working directory, which
Python itself puts first). A folder asyncflow put there would be searched for every later import of
the process: a `csv.py` in a model folder or in the working directory would run in place of the
standard library's. So no model folder, data folder, working directory or reward file's folder is
ever added.

A file is loaded by its path, as a module of a package of its own whose only folder is the file's
folder: the helpers beside it import relatively (`from . import helpers`, `from .helpers import norm`),
and nothing else is looked up there.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncflow.errors import UserError

FILE_PACKAGE_PREFIX = "asyncflow_user_files_"  # + a digest of the folder: the package a loaded file belongs to


def load_attr(spec: str, key: str, what: str = "function") -> Any:
    """What `spec` names: `module:attr` imported from `sys.path` as Python set it up, or
    `path/to/file.py:attr` loaded by its path (a relative one from the working directory). Any
    failure is one line naming `key`; `what` says what the attribute should be."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UserError(f"{key}: {spec!r} must be 'module:{what}' or 'path/to/file.py:{what}'")
    is_file = module_name.endswith(".py")
    module = load_file(module_name, key) if is_file else import_named(module_name, attr, key)
    found = getattr(module, attr, None)
    if found is None:
        raise UserError(f"{key}: {'file' if is_file else 'module'} {module_name!r} has no {what} {attr!r}")
    return found


def import_named(name: str, attr: str, key: str) -> ModuleType:
    """`importlib.import_module(name)`; any failure is one line naming `key` (the module is the
    user's: `sys.exit()` or a module-level argparse in it must not end asyncflow with its code)."""
    try:
        return importlib.import_module(name)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise UserError(f"{key}: cannot import module {name!r}: {type(exc).__name__}: {exc}"
                        f"{_not_found_hint(name, attr, exc)}") from None


def _not_found_hint(name: str, attr: str, exc: BaseException) -> str:
    """What to write instead when the named module itself was not found (not one it imports)."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not missing or not (name == missing or name.startswith(missing + ".")):
        return ""
    if "/" in name or name.endswith(".py"):
        return " (a file is given as 'path/to/file.py:function')"
    rel = name.replace(".", "/") + ".py"
    if (Path.cwd() / rel).is_file():
        return (f" (the working directory is not searched for modules: name the file, '{rel}:{attr}', "
                "or add the working directory to PYTHONPATH)")
    return ""


def load_file(given: str, key: str) -> ModuleType:
    """The module of the `.py` file `given` (a relative path is taken from the working directory),
    loaded once per file; any failure is one line naming `key`."""
    path = Path(given).expanduser()
    file = path if path.is_absolute() else Path.cwd() / path
    if not file.is_file():
        where = "" if path.is_absolute() else f" in {Path.cwd()}"
        raise UserError(f"{key}: no file {given!r}{where}")
    file = file.resolve()
    package = _file_package(file.parent)
    # a name that cannot be a module's (a '.' or '-' in the stem) gets one derived from the whole path
    stem = file.stem if file.stem.isidentifier() else "file_" + _digest(str(file))
    name = f"{package}.{stem}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickle look their module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # (SystemExit included, as in `import_named`)
        del sys.modules[name]
        if isinstance(exc, KeyboardInterrupt):
            raise
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and (file.parent / f"{exc.name}.py").is_file():
            hint = f" (its folder is not on sys.path: import the helper beside it as `from . import {exc.name}`)"
        raise UserError(f"{key}: cannot load {str(file)!r}: {type(exc).__name__}: {exc}{hint}") from None
    return module


def _file_package(folder: Path) -> str:
    """The name of the package whose one folder is `folder` (made once per folder): the files loaded
    from it are its modules, so they import each other relatively, and only from there."""
    name = FILE_PACKAGE_PREFIX + _digest(str(folder))
    if name not in sys.modules:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        sys.modules[name] = importlib.util.module_from_spec(spec)
    return name


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
