"""The sandbox against code that attacks it: as root (CI, containers) and as an unprivileged user.

Each test is an attack that worked before the sandbox confined the code's process (its own user id
or user namespace, no capabilities, no_new_privs, a seccomp filter, private /tmp): it must fail now,
and the sandbox must report only layers it saw hold.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from asyncflow.rewards import sandbox_verify
from asyncflow.rewards.sandbox import run_code

LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="the isolation layers are Linux's")

_ATTACKS = textwrap.dedent("""
    import ctypes, os, json
    libc = ctypes.CDLL(None, use_errno=True)
    out = {"uid": os.getuid()}
    out["umount_proc"] = libc.umount2(b"/proc", 2)
    out["unshare_user"] = libc.unshare(0x10000000)
    fd = os.open("/proc/self/ns/net", os.O_RDONLY)
    out["setns"] = libc.setns(fd, 0)
    out["mount_tmpfs"] = libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)
    raised = []
    for line in open("/proc/self/cgroup"):
        path = line.rstrip().split(":", 2)[2]
        for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/pids"):
            try:  # the permission check alone: nothing is written
                os.close(os.open(root + path.rstrip("/") + "/pids.max", os.O_WRONLY))
                raised.append(root)
            except OSError:
                pass
    out["pids_max_raised"] = raised
    status = dict(l.rstrip(chr(10)).split(":\\t", 1) for l in open("/proc/self/status") if ":\\t" in l)
    out["caps"] = [status[k] for k in ("CapPrm", "CapEff", "CapBnd")]
    out["no_new_privs"] = status["NoNewPrivs"]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("processes", ["auto", "fallback"])
def test_the_code_keeps_no_privilege_to_undo_its_namespaces(processes: str) -> None:
    """As root the code unmounted /proc, joined the trainer's network namespace and raised its own
    pids limit; as a user it unmounted /proc to see the host's processes. Without namespaces
    (`fallback`) the privileges are given up all the same."""
    res = run_code(_ATTACKS, processes=processes)  # type: ignore[arg-type]
    assert res.status == "ok", res.stderr
    out = json.loads(res.stdout)
    assert out["umount_proc"] == out["unshare_user"] == out["setns"] == out["mount_tmpfs"] == -1
    assert out["caps"][:2] == ["0000000000000000"] * 2 and out["no_new_privs"] == "1"
    assert {"caps_dropped", "no_new_privs", "seccomp"} <= set(res.isolation)
    if processes == "auto":
        assert out["pids_max_raised"] == [] and out["caps"][2] == "0000000000000000" and "proc" in res.isolation
    if os.geteuid() == 0 and "uid_switch" in res.isolation:
        assert out["uid"] != 0
    if os.geteuid() == 0 and processes == "auto":
        assert "uid_switch" in res.isolation  # the mount namespace exposes the interpreter to the code's user


def _unix_server(tmp_root: Path) -> tuple[socket.socket, Path]:
    """A listening Unix socket at a path the sandboxed code can see (not under the private /tmp)."""
    folder = tmp_root / f"asyncflow-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    path = folder / "s"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen(4)
    server.settimeout(0.3)
    return server, path


def test_no_socket_reaches_a_host_service_by_path_or_by_any_alias() -> None:
    """A network namespace does not cover Unix sockets (Docker's, a database's, Ray's raylet), and
    `_socket.SocketType` or the class found through `object.__subclasses__()` got past the guard."""
    server, path = _unix_server(Path("/var/tmp"))
    code = textwrap.dedent(f"""
        import _socket, ctypes, socket, struct
        tried = {{}}
        def attempt(name, make):
            try:
                s = make()
                s.connect({str(path)!r})
                tried[name] = "connected"
            except OSError as exc:
                tried[name] = type(exc).__name__
        attempt("SocketType", lambda: _socket.SocketType(socket.AF_UNIX))
        real = [c for c in object.__subclasses__() if c.__module__ == "_socket" and c.__name__ == "socket"][0]
        attempt("subclasses", lambda: real(socket.AF_UNIX))
        libc = ctypes.CDLL(None, use_errno=True)
        tried["libc_unix"] = libc.socket(1, 1, 0)
        tried["libc_tcp"] = libc.socket(2, 1, 0)
        print(tried)
    """)
    try:
        res = run_code(code)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing connected
    finally:
        server.close()
        shutil.rmtree(path.parent, ignore_errors=True)
    tried = ast.literal_eval(res.stdout)
    assert tried == {"SocketType": "NetworkBlocked", "subclasses": "PermissionError", "libc_unix": -1, "libc_tcp": -1}


def test_files_in_tmp_and_dev_shm_do_not_outlive_the_call() -> None:
    name = f"asyncflow-test-{uuid.uuid4().hex[:8]}"
    code = f"for d in ('/tmp', '/dev/shm'):\n    open(d + '/{name}', 'w').write('x')\nprint('wrote')\n"
    res = run_code(code)
    assert res.status == "ok" and res.stdout == "wrote\n", res.stderr
    assert "tmp_private" in res.isolation
    assert not Path("/tmp", name).exists() and not Path("/dev/shm", name).exists()


def test_isolation_reports_only_layers_the_probe_saw_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer the sandbox applied but the probe found broken reads `LAYER_unverified: WHY`."""
    proven = {layer: "" for layer in sandbox_verify.PROBED} | {"seccomp": "a Unix socket could be opened"}
    assert sandbox_verify.annotate(["pidns", "seccomp", "tmpdir"], proven) == [
        "pidns", "seccomp_unverified: a Unix socket could be opened", "tmpdir"]
    monkeypatch.setattr(sandbox_verify, "_cache", {(sys.executable, "auto"): proven})
    res = run_code("print(1)")
    assert res.status == "ok" and "seccomp_unverified: a Unix socket could be opened" in res.isolation
    refused = run_code("print(1)", require=["seccomp"])
    assert (refused.status, refused.exit_code, refused.stdout) == ("error", None, "")
    assert "seccomp (a Unix socket could be opened)" in refused.stderr


def test_a_required_layer_that_is_missing_refuses_to_run_the_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    absent = "userns" if os.geteuid() == 0 else "uid_switch"  # root switches users; a user gets a namespace
    monkeypatch.setenv("ASYNCFLOW_SANDBOX_REQUIRE", f"seccomp, {absent}")
    res = run_code(code)
    assert (res.status, res.exit_code) == ("error", None) and f"{absent} (" in res.stderr and not marker.exists()
    with pytest.raises(ValueError, match="cannot require nosuch"):
        run_code("pass", require=["nosuch"])
    held = [x for x in run_code("pass", require=[]).isolation if x in sandbox_verify.PROBED]
    assert run_code("print(1)", require=held).status == "ok"


def _readable_package() -> str:
    """A copy of the package's Python files in a folder every user may read (the checkout itself may
    sit under a folder closed to other users, as a CI clone under a private temporary folder does)."""
    root = tempfile.mkdtemp(prefix="asyncflow-unpriv-")
    os.chmod(root, 0o755)
    shutil.copytree(Path(__file__).parents[1] / "asyncflow", Path(root) / "asyncflow",
                    ignore=lambda folder, names: [n for n in names if not n.endswith(".py")
                                                  and not (Path(folder) / n).is_dir()])
    for folder, _, _ in os.walk(root):
        os.chmod(folder, 0o755)
    return root


def _python_for(uid: int, root: str) -> str | None:
    """An interpreter user `uid` can run (and start again) with `root`'s asyncflow importable, or None."""
    for python in (sys.executable, "/usr/bin/python3"):
        probe = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", python, "-c",
                 f"import subprocess, sys; sys.path.insert(0, {root!r}); import asyncflow.rewards.sandbox; "
                 "sys.exit(subprocess.run([sys.executable, '-c', 'pass']).returncode)"]  # it can start itself
        if shutil.which(python) and subprocess.run(probe, capture_output=True, timeout=60).returncode == 0:
            return python
    return None


def test_as_an_unprivileged_user_the_same_attacks_fail() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to become an unprivileged user")
    root = _readable_package()
    try:
        python = _python_for(65534, root)
        if python is None:
            pytest.skip("no interpreter that user 65534 can run here")
        script = (f"import sys; sys.path.insert(0, {root!r})\nfrom asyncflow.rewards.sandbox import run_code\n"
                  f"res = run_code({_ATTACKS!r}, python=sys.executable)\nprint(repr((res.status, res.isolation)))\n"
                  "print(res.stdout)\n")
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script],
                              capture_output=True, text=True, timeout=120, cwd="/")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    status, isolation = ast.literal_eval(done.stdout.splitlines()[0])
    if any(x.startswith("pidns_unavailable") for x in isolation):
        pytest.skip(f"no user namespace for an unprivileged user here: {isolation}")
    assert status == "ok", done.stdout
    out = json.loads(done.stdout.splitlines()[1])
    assert status == "ok" and {"userns", "caps_dropped", "no_new_privs", "seccomp", "proc"} <= set(isolation)
    assert out["umount_proc"] == out["unshare_user"] == out["setns"] == -1 and out["uid"] == 65534
    assert out["caps"] == ["0000000000000000"] * 3


def test_reward_sandbox_require_is_checked_and_reaches_every_scoring_process(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.errors import UserError
    from asyncflow.rewards import load_run_reward
    from asyncflow.rewards.sandbox import REQUIRE_ENV

    with pytest.raises(UserError, match="reward.sandbox_require: unknown layer 'seccom'"):
        load_config(None, ["task=arith", "reward.sandbox_require=[seccomp, seccom]"])
    monkeypatch.setenv(REQUIRE_ENV, "")  # (recorded, so the value the run sets is undone after the test)
    absent = "userns" if os.geteuid() == 0 else "uid_switch"
    reward = tmp_path / "reward.py"
    reward.write_text("from asyncflow.rewards.sandbox import run_code\n"
                      "def score(prompts, completions, **kw):\n"
                      "    return [1.0 if run_code('print(1)').stdout == '1\\n' else 0.0 for _ in completions]\n")
    cfg, _ = load_config(None, ["task=arith", f"reward.sandbox_require=[{absent}]"])
    fn = load_run_reward(cfg, f"{reward}:score")
    assert os.environ[REQUIRE_ENV] == absent
    assert fn(["p"], ["c"]) == [0.0]  # refused: the required layer does not hold here
    monkeypatch.setenv(REQUIRE_ENV, "seccomp")
    assert fn(["p"], ["c"]) == [1.0]
