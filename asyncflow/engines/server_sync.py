"""Weight sync to OpenAI-compatible servers: a folder writer plus one small backend per server type.

The trainer's weights reach a remote server through the file system: each published version is
written once (shared by every engine of the run) as a Hugging Face folder, then each server is told
to load it through its own HTTP API:

    version v ─► WeightFolderWriter (once) ─► folder ─► WeightSync.load(server, folder, v, mode)
                                                        asyncflow: POST /admin/load_weights
                                                        vllm:      POST /pause, /collective_rpc reload_weights, /resume
                                                        sglang:    POST /update_weights_from_disk

A LoRA run (`model.lora`) publishes an adapter: it is written as a PEFT adapter folder
(adapter_config.json + adapter_model.safetensors) and loaded through `WeightSync.load_adapter`:
asyncflow serve merges it through the same admin route; vLLM loads it with `POST /v1/load_lora_adapter`
(the server runs with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) and SGLang with
`POST /load_lora_adapter`; requests then name the adapter.

So the writers (the driver's engines, or on Ray the rollout actors, which take turns through a file
lock in the folder) and the servers must share a file system (one machine, or a shared mount).
Only the asyncflow backend is exercised against a real server in this repository's tests; the vLLM
and SGLang backends are written against those projects' documented HTTP APIs and unit-tested for
the requests they send (docs/engines.md).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import IO, Any

from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.base import WeightUpdateMode
from asyncflow.engines.http_client import HTTPError, request_json
from asyncflow.engines.safetensors_io import try_lock_exclusive, write_file
from asyncflow.engines.weight_delta import DELTA_FILE, PUBLICATION_FILE, Publication, skeleton_json, split
from asyncflow.engines.weight_sync import aliases
from asyncflow.errors import WaitTimeout

SERVER_TYPES = ("asyncflow", "vllm", "sglang")
_MODEL_FILES = (".json", ".txt", ".model", ".jinja", ".py")  # what a served folder needs besides weights


class WeightSync(abc.ABC):
    """Tells one server to load a weight folder as a new version."""

    in_place = False  # True: the server reloads from the folder it was started with (the writer overwrites it)
    # True: the server reads a version's weights under a shared lock (`safetensors_io.map_file`), so
    # the writer may overwrite an old version's files for a new one once no server maps them
    locks_reads = False

    @abc.abstractmethod
    async def load(self, base_url: str, folder: Path, version: int, mode: WeightUpdateMode, *,
                   token: str | None, timeout: float) -> None:
        """Make the server at `base_url` generate with the weights in `folder` from now on."""

    async def load_adapter(self, base_url: str, folder: Path, version: int, mode: WeightUpdateMode, *,
                           token: str | None, timeout: float) -> str | None:
        """Make the server generate with the PEFT adapter in `folder`; returns the name requests must
        give to use it (None: the server merged it into its model, which keeps its name)."""
        await self.load(base_url, folder, version, mode, token=token, timeout=timeout)
        return None


class AsyncflowSync(WeightSync):
    """`asyncflow serve`: one call; the server applies drain/swap/abort itself and reports per-token versions."""

    locks_reads = True  # (`read_weights` maps each file with `map_file`)

    async def load(self, base_url: str, folder: Path, version: int, mode: WeightUpdateMode, *,
                   token: str | None, timeout: float) -> None:
        body = {"path": str(folder.resolve()), "version": version, "mode": mode}
        reply = await request_json("POST", f"{base_url}/admin/load_weights", body, token=token, timeout=timeout)
        if not isinstance(reply, dict) or reply.get("version") != version:
            raise HTTPError(200, f"{base_url}/admin/load_weights: expected version {version} back, got {reply!r}")


class VLLMSync(WeightSync):
    """vLLM's development-mode routes (the server runs with VLLM_SERVER_DEV_MODE=1): pause generation,
    reload the weights from the folder vLLM was started with (`collective_rpc` of the worker method
    `reload_weights`, which reads them from disk when given no tensors), resume. drain maps to
    pause mode `wait`, swap to `keep` (requests freeze and continue on the new weights), abort to `abort`."""

    in_place = True
    PAUSE_MODES = {"drain": "wait", "swap": "keep", "abort": "abort"}

    async def load(self, base_url: str, folder: Path, version: int, mode: WeightUpdateMode, *,
                   token: str | None, timeout: float) -> None:
        async def resume() -> None:
            await request_json("POST", f"{base_url}/resume", {}, token=token, timeout=timeout)

        try:  # (from before the pause: a pause that times out or is cancelled may still take effect)
            await request_json("POST", f"{base_url}/pause?mode={self.PAUSE_MODES[mode]}", {}, token=token, timeout=timeout)
            await request_json("POST", f"{base_url}/collective_rpc",
                               {"method": "reload_weights", "timeout": timeout}, token=token, timeout=timeout)
        except BaseException:
            with contextlib.suppress(Exception):  # (the first error is the one to report)
                await resume()
            raise
        await resume()


    async def load_adapter(self, base_url: str, folder: Path, version: int, mode: WeightUpdateMode, *,
                           token: str | None, timeout: float) -> str | None:
        """`POST /v1/load_lora_adapter` under one name, replaced in place each version (`load_inplace`);
        requests in flight finish on the adapter they started with (modes do not apply). Untested here."""
        body = {"lora_name": ADAPTER_NAME, "lora_path": str(folder.resolve()), "load_inplace": True}
        await post_accepting_text(f"{base_url}/v1/load_lora_adapter", body, token=token, timeout=timeout)
        return ADAPTER_NAME


ADAPTER_NAME = "asyncflow-lora"  # the served adapter's name on vLLM and SGLang


async def post_accepting_text(url: str, body: Any, *, token: str | None, timeout: float) -> Any:
    """A POST whose successful reply may be plain text (vLLM's LoRA routes answer "Success: ...")."""
    try:
        return await request_json("POST", url, body, token=token, timeout=timeout)
    except HTTPError as exc:
        if exc.status == 200:
            return None
        raise


class SGLangSync(WeightSync):
    """SGLang's `POST /update_weights_from_disk {model_path, abort_all_requests, weight_version}`;
    abort aborts in-flight requests first, drain and swap let SGLang finish them before it loads."""

    async def load(self, base_url: str, folder: Path, version: int, mode: WeightUpdateMode, *,
                   token: str | None, timeout: float) -> None:
        body = {"model_path": str(folder.resolve()), "abort_all_requests": mode == "abort",
                "weight_version": str(version)}
        reply = await request_json("POST", f"{base_url}/update_weights_from_disk", body, token=token, timeout=timeout)
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise HTTPError(200, f"{base_url}/update_weights_from_disk failed: {reply!r}")


    async def load_adapter(self, base_url: str, folder: Path, version: int, mode: WeightUpdateMode, *,
                           token: str | None, timeout: float) -> str | None:
        """`POST /unload_lora_adapter` of the previous version's name, then `POST /load_lora_adapter`
        under this version's (SGLang refuses a name already loaded). Untested here."""
        name = f"{ADAPTER_NAME}-v{version}"
        if version > 0:
            with contextlib.suppress(HTTPError):  # (none loaded yet: a start or a restarted server)
                await post_accepting_text(f"{base_url}/unload_lora_adapter", {"lora_name": f"{ADAPTER_NAME}-v{version - 1}"},
                                          token=token, timeout=timeout)
        reply = await post_accepting_text(f"{base_url}/load_lora_adapter",
                                          {"lora_name": name, "lora_path": str(folder.resolve())}, token=token, timeout=timeout)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise HTTPError(200, f"{base_url}/load_lora_adapter failed: {reply!r}")
        return name


def on_memory_fs(path: Path) -> bool:
    """Whether `path` lies on a memory file system (tmpfs, ramfs: /dev/shm), by the longest mount
    point above it in /proc/mounts (False where there is none)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    where, best, kind = path.resolve(), -1, ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].replace("\\040", " ").replace("\\011", "\t"))
        if where.is_relative_to(point) and len(point.parts) > best:
            best, kind = len(point.parts), fields[2]
    return kind in ("tmpfs", "ramfs")


def sync_root(rollout: Any, run_dir: Path) -> Path:
    """The folder a run writes its weight versions to for its servers (`rollout.sync_dir`, else
    `run_dir/weight_sync`); a server the run starts loads weights from nowhere else."""
    return Path(rollout.sync_dir) if rollout.sync_dir is not None else run_dir / "weight_sync"


def make_weight_sync(server_type: str) -> WeightSync:
    """The backend for `rollout.server_type`."""
    backends: dict[str, type[WeightSync]] = {"asyncflow": AsyncflowSync, "vllm": VLLMSync, "sglang": SGLangSync}
    if server_type not in backends:
        raise ValueError(f"unknown server type {server_type!r}; known: {', '.join(SERVER_TYPES)}")
    return backends[server_type]()


class WeightFolderWriter:
    """Writes each version's weights once, however many engines ask, as a loadable HF folder.

    Versioned (default): `root/v000001/` with the model folder's config files and `model.safetensors`;
    folders two versions old are removed. Each is written as a hidden `.vNNNNNN.tmp` folder and
    renamed into place once complete (its `MARKER` inside), so a reader never sees a half-written one.
    With `reuse_files` (the servers lock what they read: `WeightSync.locks_reads`) on a memory file
    system, the new version is written over the files of one two or more versions old that no server
    maps (renamed to the hidden folder first): its memory is already allocated (`safetensors_io`).
    In place (vLLM): `root/model.safetensors` is replaced atomically, `root` being the folder the
    server was started with.

    Once across processes too (the Ray rollout actors each hold a writer): writes take a file lock
    in `root`, and a version already written by a writer of the same `session` (one per run start,
    shared by all its engines) is reused; one another session wrote is written again, so a resumed
    run or a reused `rollout.sync_dir` never serves an older run's weights under the same number."""

    MARKER = ".asyncflow-writer"  # in a written folder: "<session> <version>"

    def __init__(self, root: Path, model_dir: Path, *, in_place: bool, session: str = "",
                 lock_timeout_s: float = 600.0, reuse_files: bool = False) -> None:
        self.root = root
        self.model_dir = model_dir
        self.in_place = in_place
        # (where it pays, and where the readers' locks and the writer's share one kernel)
        self.reuse_files = reuse_files and not in_place and on_memory_fs(root)
        self.reused = 0  # versions written over an old version's files
        self.session = session or secrets.token_hex(8)
        self.lock_timeout_s = lock_timeout_s
        self._writes: dict[tuple[int, bool], asyncio.Task[Path]] = {}  # (version, delta) -> its write

    async def folder_for(self, state: dict[str, Any] | Publication, version: int) -> Path:
        """The folder holding `version` (written by the first caller; the others wait for it). A
        delta `Publication` is written as `root/d<version>/` (`DELTA_FILE` + `PUBLICATION_FILE`), a
        full one as the plain folder with its `PUBLICATION_FILE`."""
        key = (version, isinstance(state, Publication) and state.is_delta)
        task = self._writes.get(key)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(self._write_once, state, version))
            self._writes[key] = task
            for old in [k for k in self._writes if k[0] < version - 1]:
                del self._writes[old]
        return await task

    def _write_once(self, state: dict[str, Any] | Publication, version: int) -> Path:
        """`_write` under the root's lock, unless this session already wrote `version` there."""
        if isinstance(state, Publication):
            folder = self.root / f"d{version:06d}" if state.is_delta else self._folder(state.tensors, version)
        else:
            folder = self._folder(state, version)
        stamp = f"{self.session} {version}"
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".asyncflow-write.lock", "a") as lock:
            deadline = time.monotonic() + self.lock_timeout_s
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise WaitTimeout(f"timed out after {self.lock_timeout_s:g} s waiting for the lock on "
                                          f"{self.root} to write policy version {version} (another writer holds it)") from None
                    time.sleep(0.05)
            try:
                marker = folder / self.MARKER
                if marker.is_file() and marker.read_text() == stamp:
                    return folder
                if not isinstance(state, Publication):
                    return self._write(state, version, stamp)
                if state.is_delta:
                    return self._write_delta(state, version, stamp)
                written = self._write(state.tensors, version, stamp)
                if not self.in_place:  # (under the lock: no engine of this session reads it before)
                    (written / PUBLICATION_FILE).write_text(skeleton_json(state))
                return written
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _folder(self, state: dict[str, Any], version: int) -> Path:
        """Where a full state (or an adapter) of `version` is written."""
        if lora_adapter.is_adapter(state):
            return self.root / f"a{version:06d}"
        return self.root if self.in_place else self.root / f"v{version:06d}"

    def _write_delta(self, pub: Publication, version: int, stamp: str) -> Path:
        """A delta publication as `root/d<version>/` (older ones removed)."""
        final = self.root / f"d{version:06d}"
        tmp = self.root / f".d{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        flat, skeleton = split(pub)
        write_file(flat, tmp / DELTA_FILE, metadata={"format": "pt"})
        (tmp / PUBLICATION_FILE).write_text(skeleton_json(skeleton))
        (tmp / self.MARKER).write_text(stamp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.root.glob("d*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _write(self, state: dict[str, Any], version: int, stamp: str) -> Path:
        if lora_adapter.is_adapter(state):  # (in a versioned folder even for vLLM: it loads adapters by path)
            return self._write_adapter(state, version, stamp)
        # tensor by tensor from their own memory (safetensors' save_file first copies the whole state)
        same = aliases(state)  # (a tied weight once, as save_pretrained writes it; readers tie it again)
        tensors = {k: v.detach() for k, v in state.items() if k not in same}
        if self.in_place:
            self._check_in_place_folder()
            tmp = self.root / "model.safetensors.tmp"
            write_file(tensors, tmp, metadata={"format": "pt"})
            os.replace(tmp, self.root / "model.safetensors")
            (self.root / f"{self.MARKER}.tmp").write_text(stamp)
            os.replace(self.root / f"{self.MARKER}.tmp", self.root / self.MARKER)
            return self.root
        final = self.root / f"v{version:06d}"
        tmp = self.root / f".v{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        held = self._take_old_folder(version, tmp) if self.reuse_files else None
        try:
            if held is None:
                tmp.mkdir()
            for f in self.model_dir.iterdir():
                if f.is_file() and f.suffix in _MODEL_FILES and not f.name.endswith(".safetensors.index.json"):
                    shutil.copy2(f, tmp / f.name)
            write_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        finally:
            if held is not None:
                held.close()  # (the lock: no reader can reach the file before the rename below)
        (tmp / self.MARKER).write_text(stamp)  # (inside the folder before it appears: present iff complete)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.root.glob("v*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _take_old_folder(self, version: int, tmp: Path) -> IO[bytes] | None:
        """Rename the oldest version folder this write may reuse to `tmp`, holding its weights file's
        exclusive lock (returned: keep it until the file is rewritten); None if none is free. May be
        reused: a version before `version - 1` (one engines may still load is kept) or another
        session's `version`, whose `model.safetensors` no reader maps (it holds a shared lock while
        it does). A reader that opened it before the rename finds its path gone (`map_file`)."""
        olds = sorted(int(d.name[1:]) for d in self.root.glob("v*") if d.is_dir() and d.name[1:].isdigit())
        for old in [v for v in olds if v < version - 1 or v == version]:
            folder = self.root / f"v{old:06d}"
            try:  # (never through a link: only a file of its own is overwritten)
                f = os.fdopen(os.open(folder / "model.safetensors", os.O_RDWR | os.O_NOFOLLOW), "r+b")
            except OSError:
                continue
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or not try_lock_exclusive(f):
                f.close()
                continue
            try:
                os.replace(folder, tmp)
                for leftover in tmp.iterdir():  # (it then holds what a fresh folder would)
                    if leftover.is_dir() and not leftover.is_symlink():
                        shutil.rmtree(leftover)
                    elif leftover.name != "model.safetensors":
                        leftover.unlink()
            except BaseException:
                f.close()
                raise
            self.reused += 1
            return f
        return None

    def _write_adapter(self, state: dict[str, Any], version: int, stamp: str) -> Path:
        """A published LoRA adapter as the PEFT folder `root/a<version>/` (older ones removed)."""
        final = self.root / f"a{version:06d}"
        tmp = self.root / f".a{version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        lora_adapter.write_folder(state, tmp)
        (tmp / self.MARKER).write_text(stamp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.root.glob("a*"):
            if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def _check_in_place_folder(self) -> None:
        if not (self.root / "config.json").is_file():
            raise RuntimeError(f"rollout.sync_dir: {self.root} is not the model folder the server was started with "
                               "(no config.json)")
        others = [f.name for f in self.root.iterdir()
                  if (f.name.endswith(".safetensors") and f.name != "model.safetensors")
                  or f.name.endswith(".safetensors.index.json")]
        if others:
            raise RuntimeError(f"rollout.sync_dir: {self.root} holds sharded weights ({others[0]}); the server would "
                               "load them along with the new model.safetensors — start it from a single-file copy")
