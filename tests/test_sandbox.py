"""The code sandbox: each limit holds, and what it reports matches what happened."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncflow.rewards import sandbox
from asyncflow.rewards.sandbox import SandboxLimits, run_code, run_tests


def test_a_normal_program_reads_stdin_and_reports_ok() -> None:
    res = run_code("print(input()[::-1])", stdin="abc\n")
    assert (res.status, res.stdout, res.exit_code) == ("ok", "cba\n", 0)
    assert {"rlimits", "socket_guard", "tmpdir", "clean_env"} <= set(res.isolation)
    assert any(i == "netns" or i.startswith("netns_unavailable") for i in res.isolation)


def test_an_exception_is_an_error_with_its_traceback() -> None:
    res = run_code("raise ValueError('bad answer')")
    assert res.status == "error" and res.exit_code == 1 and "ValueError: bad answer" in res.stderr
    assert '"<solution>", line 1' in res.stderr and "<string>" not in res.stderr  # only the code's own frames


def test_an_infinite_loop_hits_the_cpu_limit() -> None:
    res = run_code("while True:\n    pass\n", limits=SandboxLimits(timeout_s=60, cpu_s=1))
    assert res.status == "cpu_limit" and res.seconds < 60


def test_ignoring_the_cpu_signal_still_hits_the_hard_cpu_limit() -> None:
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    res = run_code(code, limits=SandboxLimits(timeout_s=60, cpu_s=1))
    assert res.status == "cpu_limit" and res.seconds < 60


def test_a_sleep_hits_the_wall_clock_limit() -> None:
    res = run_code("import time\ntime.sleep(60)\n", limits=SandboxLimits(timeout_s=1))
    assert res.status == "timeout" and res.seconds < 10


def test_a_huge_list_hits_the_memory_limit() -> None:
    res = run_code("x = [0] * 10**9\nprint('allocated')\n", limits=SandboxLimits(memory_mb=256))
    assert res.status == "memory_limit" and "allocated" not in res.stdout


def test_a_socket_connect_is_blocked() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        res = run_code(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')\n")
        assert res.status == "network_blocked" and "network access is disabled" in res.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
    finally:
        server.close()


def test_a_caught_socket_error_still_reports_network_blocked_on_failure() -> None:
    res = run_code("import socket, sys\ntry:\n    socket.socket()\nexcept OSError:\n    sys.exit(3)\n")
    assert res.status == "network_blocked" and res.exit_code == 3


def test_the_network_namespace_leaves_only_loopback() -> None:
    res = run_code("print(open('/proc/net/dev').read())")
    if "netns" not in res.isolation:
        pytest.skip(f"no network namespace here: {res.isolation}")
    devices = [line.split(":")[0].strip() for line in res.stdout.splitlines()[2:] if line.strip()]
    assert devices == ["lo"]


def test_files_land_in_a_temporary_directory_that_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = "import os\nopen('out.txt', 'w').write('x')\nos.makedirs('sub/deep')\nos.chmod('sub', 0)\nprint(os.getcwd())\n"
    res = run_code(code)
    assert res.status == "ok", res.stderr
    workdir = Path(res.stdout.strip())
    assert workdir != tmp_path and not workdir.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_large_file_hits_the_file_size_limit() -> None:
    res = run_code("open('big', 'wb').write(b'x' * (3 * 2**20))\n", limits=SandboxLimits(max_file_mb=1))
    assert res.status == "error" and "File too large" in res.stderr


def test_environment_secrets_are_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCFLOW_TEST_SECRET", "hunter2")
    res = run_code("import os\nprint(dict(os.environ))\n")
    assert res.status == "ok" and "hunter2" not in res.stdout and "ASYNCFLOW_TEST_SECRET" not in res.stdout


def test_output_is_truncated_at_the_cap() -> None:
    res = run_code("import sys\nprint('x' * 10**6)\nsys.stderr.write('e' * 10**6)\n",
                   limits=SandboxLimits(max_output_bytes=1000))
    assert res.status == "ok" and res.truncated
    assert res.stdout == "x" * 1000 and res.stderr == "e" * 1000


def _leaver(tag: str, setsid: bool) -> str:
    """Code that leaves a process behind (in its own session with `setsid`), named `tag`; it returns
    once that process runs. The host sees nothing else of it: the code cannot write the host's files."""
    child = "    os.setsid()\n" if setsid else ""
    return (f"import ctypes, os, time\nr, w = os.pipe()\nif os.fork() == 0:\n{child}"
            f"    ctypes.CDLL(None).prctl(15, {tag.encode()!r}, 0, 0, 0)\n    os.write(w, b'x')\n"
            "    while True:\n        time.sleep(0.05)\nos.read(r, 1)\n")


def _named(tag: str) -> list[int]:
    """Live (not zombie) processes on the host named `tag`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name == tag and state != "Z":
            found.append(int(pid))
    return found


def _assert_gone(tag: str) -> None:
    """Every process named `tag` ends within a few seconds (one left behind would live forever)."""
    deadline = time.monotonic() + 5
    while _named(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _named(tag) == [], f"a process left behind ({tag}) still runs after run_code returned"


def test_processes_left_behind_are_killed() -> None:
    res = run_code(_leaver("af-left", setsid=False), limits=SandboxLimits(timeout_s=30))
    assert res.status == "ok", res.stderr
    _assert_gone("af-left")


@pytest.mark.parametrize("processes", ["auto", "fallback"])
def test_a_setsid_grandchild_is_gone_when_run_code_returns(processes: str) -> None:
    res = run_code(_leaver("af-setsid", setsid=True), limits=SandboxLimits(timeout_s=30), processes=processes)
    assert res.status == "ok", res.stderr
    _assert_gone("af-setsid")
    if processes == "fallback":
        assert "pidns_unavailable: fallback requested" in res.isolation and "subreaper" in res.isolation


def test_a_setsid_grandchild_is_gone_after_a_timeout_too() -> None:
    res = run_code(_leaver("af-setsid-t", setsid=True) + "time.sleep(60)\n", limits=SandboxLimits(timeout_s=1))
    assert res.status == "timeout" and res.seconds < 30
    _assert_gone("af-setsid-t")


def _require_pid_namespace() -> list[str]:
    isolation = run_code("pass").isolation
    if any(i.startswith("pidns_unavailable") for i in isolation):  # the sandbox tried; the kernel refused
        pytest.skip(f"the kernel refuses a PID namespace here: {isolation}")
    return isolation


def test_the_code_cannot_read_the_trainers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    isolation = _require_pid_namespace()
    at = isolation.index("pidns")
    assert isolation[at:at + 6] == ["pidns", "mountns", "proc", "tmp_private", "netns", "ipcns"]  # in order
    monkeypatch.setenv("ASYNCFLOW_TEST_SECRET", "hunter2")
    code = (f"import os\ntry:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
            "except OSError as exc:\n    print('refused', type(exc).__name__)\n"
            "pids = sorted(map(int, filter(str.isdigit, os.listdir('/proc'))))\nprint(pids)\nfor pid in pids:\n"
            "    try:\n        print(pid, open(f'/proc/{pid}/environ').read())\n    except OSError:\n        pass\n")
    res = run_code(code)
    assert res.status == "ok", res.stderr
    assert res.stdout.startswith("refused FileNotFoundError") and "hunter2" not in res.stdout
    assert res.stdout.splitlines()[1] == "[1, 2]"  # it sees its init and itself
    assert [line.split()[0] for line in res.stdout.splitlines()[2:]] == ["2"]  # and reads only its own environment


def test_the_code_cannot_signal_the_trainer() -> None:
    _require_pid_namespace()
    res = run_code(f"import os\nos.kill({os.getpid()}, 0)\n")
    assert res.status == "error" and "ProcessLookupError" in res.stderr


def test_the_process_count_is_bounded() -> None:
    isolation = run_code("pass", limits=SandboxLimits(max_processes=8)).isolation
    if any(i.startswith("pids_cgroup_unavailable") for i in isolation) and "nproc_rlimit" not in isolation:
        pytest.skip(f"no process limit holds here: {isolation}")
    code = ("import os, time\nmade = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        made += 1\n    except OSError:\n        break\n"
            "print(made)\n")
    res = run_code(code, limits=SandboxLimits(max_processes=8, timeout_s=30))
    assert res.status == "ok" and int(res.stdout) <= 8, (res.stdout, res.stderr)


def test_a_fork_bomb_ends_at_the_limits_and_leaves_nothing() -> None:
    isolation = run_code("pass").isolation
    if not {"pids_cgroup", "nproc_rlimit"} & set(isolation):
        pytest.skip(f"no process limit holds here: a fork bomb would hit the host: {isolation}")
    code = ("import ctypes, os\nctypes.CDLL(None).prctl(15, b'af-bomb', 0, 0, 0)\nwhile True:\n    try:\n"
            "        os.fork()\n    except OSError:\n        pass\n")
    res = run_code(code, limits=SandboxLimits(timeout_s=2, max_processes=16))
    assert res.status == "timeout" and res.seconds < 30
    _assert_gone("af-bomb")
    assert subprocess.run(["true"], timeout=30).returncode == 0  # the host can still start processes


def test_require_refuses_without_a_pid_namespace_and_fallback_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    has_pid_ns = "pidns" in run_code("pass").isolation
    monkeypatch.setenv("ASYNCFLOW_SANDBOX_PROCESSES", "require")
    required = run_code("print(1)")
    if has_pid_ns:
        assert required.status == "ok" and "pidns" in required.isolation
    else:
        assert (required.status, required.exit_code) == ("error", None) and "refused" in required.stderr
    monkeypatch.setenv("ASYNCFLOW_SANDBOX_PROCESSES", "fallback")
    res = run_code("print(1)")
    assert res.status == "ok" and "pidns" not in res.isolation and "pidns_unavailable: fallback requested" in res.isolation
    with pytest.raises(ValueError, match="processes must be"):
        run_code("print(1)", processes="off")  # type: ignore[arg-type]


def test_run_tests_gives_the_fraction_of_asserts_that_pass() -> None:
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0", "assert sub(1, 1) == 0"]
    assert run_tests("def add(a, b):\n    return a + b\n", tests) == pytest.approx(0.5)
    assert run_tests("def add(a, b) return a + b", tests) == 0.0  # does not compile
    assert run_tests("import time\ndef add(a, b):\n    time.sleep(60)\n", tests, timeout_s=1) == 0.0


def test_a_test_that_hangs_keeps_the_results_before_it() -> None:
    res = run_code("def f():\n    return 1\n", tests=["assert f() == 1", "while True: pass", "assert f() == 1"],
                   limits=SandboxLimits(timeout_s=30, cpu_s=1))
    assert res.status == "cpu_limit" and res.tests_passed == [True, False, False]


def test_the_sandbox_does_not_leave_descriptors_open() -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        run_code("print(1)")
    assert len(os.listdir("/proc/self/fd")) == before


def test_tests_larger_than_one_command_line_argument_still_run() -> None:
    big = "assert sum(" + repr(list(range(30000))) + ") == 449985000"  # ~200 KB: over Linux's 128 KiB per argument
    assert run_tests("x = 1\n", [big, "assert x == 1"]) == 1.0


def test_run_tests_raises_when_the_sandbox_itself_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sandbox.run_code
    monkeypatch.setattr(sandbox, "run_code", functools.partial(real, python="/nonexistent/python3"))
    with pytest.raises(RuntimeError, match="cannot start /nonexistent/python3"):
        sandbox.run_tests("x = 1\n", ["assert x == 1"])  # a 0.0 here would punish a correct solution


def test_run_tests_timeout_replaces_the_one_in_limits() -> None:
    slow = "import time\ntime.sleep(30)\n"
    res_limits = SandboxLimits(timeout_s=60, cpu_s=30)
    assert run_tests(slow, ["assert True"], timeout_s=1, limits=res_limits) == 0.0
    assert run_tests("x = 1\n", ["assert x == 1"], limits=res_limits) == 1.0


def test_the_code_cannot_forge_test_results_or_read_the_tests() -> None:
    tests = ["assert False", "assert 1 == 2"]
    replace_exec = "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: None\n"
    assert run_tests(replace_exec, tests) == 0.0
    forge = ("import os\nfor fd in map(int, os.listdir('/proc/self/fd')):\n"
             "    for i in range(2):\n"
             "        try:\n            os.write(fd, b'{\"test\": %d, \"passed\": true}\\n' % i)\n"
             "        except OSError:\n            pass\n")
    assert run_tests(forge, tests) == 0.0
    res = run_code("import sys, os\nprint(sys.argv)\nprint(sorted(os.listdir('.')))\n", tests=["assert True"])
    workdir = os.path.dirname(eval(res.stdout.splitlines()[0])[0])
    assert res.stdout.splitlines() == [f"['{workdir}/solution.py']", "['solution.py']"]  # no config, no tests


def test_the_code_runs_as_a_real_module() -> None:
    res = run_code("import pickle, sys\nclass P:\n    pass\nprint(len(pickle.loads(pickle.dumps([P()]))))\n"
                   "print(sys.modules['__main__'].P is P)\n")
    assert (res.status, res.stdout) == ("ok", "1\nTrue\n"), res.stderr


def test_threads_are_joined_and_atexit_runs_as_in_a_normal_exit() -> None:
    code = ("import atexit, threading, time\natexit.register(lambda: print('bye'))\n"
            "def main():\n    time.sleep(0.2)\n    print(3)\nthreading.Thread(target=main).start()\n")
    res = run_code(code)
    assert (res.status, res.stdout) == ("ok", "3\nbye\n"), res.stderr


def test_statuses_are_not_taken_from_the_codes_own_exit() -> None:
    assert (run_code("import sys\nsys.exit(86)").status, run_code("import sys\nsys.exit(87)").status) == ("error", "error")
    killed = run_code("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", limits=SandboxLimits(cpu_s=5))
    assert (killed.status, killed.exit_code) == ("error", -9)  # a kill, not the CPU limit: no CPU was used
    message = run_code("import sys\nsys.exit('usage: solve N')")
    assert (message.status, message.exit_code, message.stderr) == ("error", 1, "usage: solve N\n")


def test_a_process_that_escapes_the_group_does_not_hold_run_code() -> None:
    threads = threading.active_count()
    res = run_code(_leaver("af-escape", setsid=True), limits=SandboxLimits(timeout_s=30))
    assert res.status == "ok", res.stderr
    assert threading.active_count() == threads  # no reader thread left blocked on the escapee's pipes
    _assert_gone("af-escape")


def test_a_locked_folder_is_removed_without_root_permissions(tmp_path: Path) -> None:
    """As root (CI) every permission check passes; without the capabilities that let root ignore
    them, a folder of mode 000 made removing the work folder fail (TypeError) and leave it behind."""
    script = ("import glob, os, tempfile\nfrom asyncflow.rewards.sandbox import run_code\n"
              "res = run_code(\"import os\\nos.makedirs('a/b')\\nopen('a/b/f', 'w').write('x')\\n"
              "os.chmod('a/b', 0)\\nos.chmod('a', 0o500)\\nprint(os.getcwd())\\n\")\n"
              "print(res.status, os.path.exists(res.stdout.strip()))\n")
    cmd = [sys.executable, "-c", script]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop the capabilities")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", "--bounding-set", drop, "--inh-caps", drop, *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(sandbox.__file__).parents[2])})
    assert (done.returncode, done.stdout) == (0, "ok False\n"), done.stderr


def test_the_code_runs_without_writing_bytecode_and_with_utf8_stdio() -> None:
    """They were asked for with PYTHONDONTWRITEBYTECODE and PYTHONIOENCODING, which `python -I`
    ignores: an import by the code could write .pyc files beside the module it imported."""
    r = run_code("import sys; print(sys.flags.dont_write_bytecode, sys.flags.utf8_mode, sys.stdout.encoding); print('é')")
    assert r.status == "ok" and r.stdout.splitlines() == ["1 1 utf-8", "é"]
