"""Reading a folder of safetensors weights into a model's full state dict: what `asyncflow serve`'s
admin route `/admin/load_weights` loads. A bad folder is the caller's input: a `RequestError` (400);
one outside the server's weights root (after resolving `..` and symbolic links) is a 403; one a
weight-folder writer took over for a newer version before it was read, a 404. The weights are read
as views of memory maps that hold a shared lock on their files until the engine drops them
(`safetensors_io.map_file`), so no writer reuses a file while it is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncflow.openai_wire import RequestError


def weights_folder(path: str, root: Path | None, anywhere: bool) -> Path:
    """The folder a load request names: resolved, and inside `root` when one is set (a relative path
    is taken from it); without a root, any folder if `anywhere`, else none (a 403 saying how)."""
    if root is None:
        if not anywhere:
            raise RequestError("load_weights is off: this server is reachable beyond loopback; start it with "
                               "--weights-root DIR to load weights from folders under DIR", status=403,
                               kind="permission_error", param="path")
        return Path(path)
    folder = (root / path).resolve()
    _check_inside(folder, root)
    return folder


def _check_inside(path: Path, root: Path) -> None:
    if not path.resolve().is_relative_to(root):
        raise RequestError(f"path: {path} is outside the weights root {root} (--weights-root; `..` and symbolic "
                           "links are resolved first)", status=403, kind="permission_error", param="path")


def read_weights(folder: Path, model: Any, root: Path | None = None) -> Any:
    """A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) as a published
    adapter, which the engine merges onto its base weights (asyncflow.engines.lora); else the `*.safetensors` tensors of `folder` as a full state dict of `model` (a weight tied to a
    loaded one may be absent, as `save_pretrained` writes it); any other mismatch is a 400. With a
    `root`, every file must resolve inside it (a link in the folder must not lead out). A folder
    with a `publication.json` (delta weight sync) is a `Publication`: a delta's changes, or the
    full weights read as above with the checksum the engine proves."""
    from dataclasses import replace

    from asyncflow.engines.weight_delta import PUBLICATION_FILE, skeleton_from_json

    if not (folder / PUBLICATION_FILE).is_file():
        return _read_state(folder, model, root)
    if root is not None:
        _check_inside(folder / PUBLICATION_FILE, root)
    try:
        skeleton = skeleton_from_json((folder / PUBLICATION_FILE).read_text())
    except (ValueError, OSError) as exc:
        raise RequestError(f"path: {folder / PUBLICATION_FILE}: {exc}", param="path") from None
    if skeleton.is_delta:
        return _read_delta(folder, model, root, skeleton)
    return replace(skeleton, tensors=_read_state(folder, model, root))


def _read_delta(folder: Path, model: Any, root: Path | None, skeleton: Any) -> Any:
    """A delta publication folder (`DELTA_FILE` + `PUBLICATION_FILE`); changes to tensors the
    model lacks are a 400."""
    from asyncflow.engines.safetensors_io import FileReplaced, map_file
    from asyncflow.engines.weight_delta import DELTA_FILE, join

    path = folder / DELTA_FILE
    if root is not None:
        _check_inside(path, root)
    try:
        pub = join(skeleton, map_file(path))
    except FileReplaced as exc:
        raise RequestError(f"path: {folder} is gone: {exc}; load a newer version", status=404,
                           kind="not_found_error", param="path") from None
    except Exception as exc:  # (a missing or malformed file)
        raise RequestError(f"path: {path} cannot be read as a weight delta ({type(exc).__name__}: {exc})",
                           param="path") from None
    from asyncflow.engines.lora import ADAPTER_KEY

    unknown = sorted(set(pub.changes) - set(model.state_dict()))
    if unknown and ADAPTER_KEY not in pub.dtypes:  # (an adapter's delta changes the adapter the engine keeps)
        raise RequestError(f"path: {folder} changes weights this model does not have: {', '.join(unknown[:3])}",
                           param="path")
    return pub


def _read_state(folder: Path, model: Any, root: Path | None) -> dict[str, Any]:
    from asyncflow.engines import lora
    from asyncflow.engines.safetensors_io import FileReplaced, map_file

    if lora.is_adapter_folder(folder):
        return _read_adapter(folder, model, root)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        raise RequestError(f"path: {folder} holds no *.safetensors files", param="path")
    if root is not None:
        for f in files:
            _check_inside(f, root)
    loaded: dict[str, Any] = {}
    for f in files:
        try:
            loaded.update(map_file(f))  # (views of the page cache: the engine's load is the one copy)
        except FileReplaced as exc:  # (the writer reuses a version's files once no reader maps them)
            raise RequestError(f"path: {folder} is gone: {exc}; load a newer version", status=404,
                               kind="not_found_error", param="path") from None
        except Exception as exc:  # (safetensors' own error class, OSError): a bad file is the caller's input
            raise RequestError(f"path: {f} cannot be read as safetensors ({type(exc).__name__}: {exc})",
                               param="path") from None
    own = model.state_dict()
    unknown = sorted(set(loaded) - set(own))
    if unknown:
        raise RequestError(f"path: {folder} has weights this model does not: {', '.join(unknown[:3])}", param="path")
    by_storage: dict[int, list[str]] = {}
    for k, v in own.items():
        by_storage.setdefault(v.data_ptr(), []).append(k)
    state = {}
    for k, v in own.items():
        src = next((t for t in by_storage[v.data_ptr()] if t in loaded), None)
        if src is None:
            raise RequestError(f"path: {folder} lacks weight {k}", param="path")
        if tuple(loaded[src].shape) != tuple(v.shape):
            raise RequestError(f"path: weight {src} has shape {tuple(loaded[src].shape)}, the model {tuple(v.shape)}",
                               param="path")
        t = loaded[src]
        if t.is_floating_point() and t.numel() and not all_finite(t):  # (the decode thread would stop for good)
            raise RequestError(f"path: weight {src} holds NaN or infinite values", param="path")
        state[k] = t.to(v.dtype)
    return state


def all_finite(t: Any) -> bool:
    """Whether a float tensor holds no NaN or infinity: its min and max, which NaN and infinities
    reach (one pass, no temporary of the tensor's size; `isfinite().all()` was 12x slower on bf16)."""
    import torch

    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _read_adapter(folder: Path, model: Any, root: Path | None) -> dict[str, Any]:
    """A PEFT adapter folder as a published adapter; one that does not fit `model` is a 400."""
    from asyncflow.engines import lora

    if root is not None:
        for name in (lora.CONFIG_FILE, lora.WEIGHTS_FILE):
            _check_inside(folder / name, root)
    try:
        state = lora.read_folder(folder)
        problem = lora.adapter_mismatch(model, state)
    except Exception as exc:  # (bad JSON, a bad safetensors file, a config without r / lora_alpha)
        raise RequestError(f"path: {folder} cannot be read as a PEFT LoRA adapter ({type(exc).__name__}: {exc})",
                           param="path") from None
    if problem is not None:
        raise RequestError(f"path: {folder}: {problem}", param="path")
    return state
