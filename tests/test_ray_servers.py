"""Servers the run starts itself (`rollout.launch_servers`): real `asyncflow serve` child processes
of `ServerActor`s, found, health checked, restarted when killed, and gone when the run ends."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(arith_dir: Path, out: Path, sets: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "runtime.kind=ray", "runtime.rollout_cpus=0.5",
                                "runtime.train_cpus=0.5", "runtime.reward_cpus=0", "logging.progress=false",
                                "train.batch_size=16", "rollout.n=4", "eval.every=0", "eval.size=4",
                                "rollout.engine=openai", "rollout.launch_servers=asyncflow", "rollout.max_new_tokens=4",
                                "rollout.request_timeout_s=120", "rollout.sync_timeout_s=120",
                                "rollout.server_start_timeout_s=120", *sets])
    summary = train(cfg, out, progress_enabled=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if r["kind"] == "train"], samples


def _servers(out: Path) -> list[dict[str, Any]]:
    actors = json.loads((out / "summary.json").read_text())["actors"]
    return sorted((a for a in actors if a["role"] == "server"), key=lambda a: a["index"])


def test_ray_run_starts_its_own_servers_and_stops_them(ray_session, arith_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    summary, steps, samples = _run(arith_dir, out, ["rollout.workers=2", "train.max_steps=3"])
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    assert summary["samples"] == 48 and summary["accounting"]["lost"] == 0
    trained = [s for s in samples if s["status"] == "trained"]
    # asyncflow serve reports each token's weight version: the servers loaded the published versions
    assert len(trained) == 48 and max(s["behavior_version"] for s in trained) >= 1
    servers = _servers(out)
    assert [s["index"] for s in servers] == [0, 1] and all(s["restarts"] == 0 for s in servers)
    assert all(s["url"].startswith("http://127.0.0.1:") for s in servers) and servers[0]["url"] != servers[1]["url"]
    for s in servers:  # each server's command and pid are in its output file, and the process is gone
        log = (out / "servers" / f"server-{s['index']}.log").read_text()
        assert f"pid {s['pid']}: " in log and " serve " in log and f"--weights-root {(out / 'weight_sync').resolve()}" in log
        assert not _alive(s["pid"]), f"server process {s['pid']} outlived the run"


def test_a_killed_server_is_restarted_and_the_run_completes(ray_session, arith_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed: list[int] = []

    def kill_after_first_step() -> None:  # SIGKILL server 0 once the run has trained a step
        deadline = time.monotonic() + 80
        while time.monotonic() < deadline and not killed:
            log, metrics = out / "servers" / "server-0.log", out / "metrics.jsonl"
            pids = re.findall(r"server 0 pid (\d+):", log.read_text()) if log.exists() else []
            if pids and metrics.exists() and '"kind": "train"' in metrics.read_text():
                os.kill(int(pids[0]), signal.SIGKILL)
                killed.append(int(pids[0]))
            time.sleep(0.1)

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    summary, steps, _ = _run(arith_dir, out, ["rollout.workers=2", "train.max_steps=5"])
    killer.join(timeout=5)
    assert killed, "the run ended before a server could be killed"
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4, 5]
    assert summary["accounting"]["lost"] == 0
    first = _servers(out)[0]
    assert first["restarts"] == 1 and first["pid"] != killed[0]  # a new process, on the same URL
    assert len(re.findall(r"server 0 pid \d+:", (out / "servers" / "server-0.log").read_text())) == 2
    assert not _alive(first["pid"]) and not _alive(killed[0])


def _actor(arith_dir: Path, tmp_path: Path, model_dir: Path, restarts: int = 1) -> Any:
    """A `ServerActor` used in process (no Ray); its weights root is tmp_path/weight_sync, the folder
    a run in tmp_path writes its weight versions to."""
    from asyncflow.config import load_config
    from asyncflow.runtime.ray_servers import ServerActor

    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "runtime.kind=ray", "rollout.engine=openai",
                                "rollout.launch_servers=asyncflow", "rollout.server_start_timeout_s=60",
                                f"runtime.max_restarts={restarts}"])
    return ServerActor(0, cfg, str(model_dir), str(tmp_path / "server-0.log"), str(tmp_path / "weight_sync"))


def test_server_start_failure_is_one_line_naming_the_command_and_its_output(arith_dir: Path, tmp_path: Path) -> None:
    from asyncflow.runtime.ray_servers import ServerFailed

    actor = _actor(arith_dir, tmp_path, tmp_path / "no-such-model")
    with pytest.raises(ServerFailed) as err:
        asyncio.run(actor.start())
    msg = str(err.value)
    assert "\n" not in msg and "-m asyncflow serve" in msg and "exited with code" in msg
    assert "no-such-model" in msg.split(": ", 1)[1]  # (the tail of the server's own error)


def test_server_actor_restarts_its_dead_child_with_the_last_weights(arith_dir: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Without Ray: the actor's watch loop brings a SIGKILLed server back on the same URL, loads the
    last recorded weight folder into it, gives up after runtime.max_restarts, and stop leaves no process."""
    from asyncflow.engines.http_client import request_json
    from asyncflow.runtime.ray_servers import ServerFailed

    actor = _actor(arith_dir, tmp_path, arith_dir, restarts=1)
    v7 = tmp_path / "weight_sync" / "v000007"  # (a copy of the model folder as the version-7 weights)
    shutil.copytree(arith_dir, v7)

    async def scenario() -> None:
        url = await actor.start()
        actor.loaded(str(v7), 7)
        first = actor.proc.pid
        os.kill(first, signal.SIGKILL)
        assert await asyncio.wait_for(actor.wait_up(), 90) == url
        assert actor.restarts == 1 and actor.proc.pid != first and not _alive(first)
        assert (await request_json("GET", f"{url}/admin/version", token=actor.token, timeout=30))["version"] == 7
        said = [line for line in capsys.readouterr().out.splitlines() if "[asyncflow] ray: server 0" in line]
        assert len(said) == 1 and "exited with code -9; restarted (1 of 1)" in said[0], said
        os.kill(actor.proc.pid, signal.SIGKILL)  # no restart left: a clear error, not a hang
        with pytest.raises(ServerFailed, match=r"runtime.max_restarts=1 allows no more restarts"):
            await asyncio.wait_for(actor.wait_up(), 30)
        assert await actor.stop() is not None and not _alive(actor.proc.pid)

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(actor.stop())


def test_launched_server_commands_carry_the_flags_asyncflow_needs_and_their_token_only_in_the_environment(
        arith_dir: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.runtime.ray_servers import server_command

    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "runtime.kind=ray", "rollout.engine=openai",
                                "rollout.launch_servers=asyncflow"])
    token = "5eC7e7" * 8
    for kind, want, var in [
        ("asyncflow", ["-m asyncflow serve /m", "--weights-root /run/weight_sync"], "ASYNCFLOW_SERVE_TOKEN"),
        ("vllm", ["serve /run/weight_sync", "--logprobs-mode processed_logprobs"], "VLLM_API_KEY"),
        ("sglang", ["-m asyncflow.runtime.secret_flag ASYNCFLOW_SGLANG_API_KEY --api-key sglang.launch_server "
                    "--model-path /m"], "ASYNCFLOW_SGLANG_API_KEY"),
    ]:
        cfg.rollout.launch_servers = kind
        cmd, env = server_command(cfg, 1, "/m", 8123, "/run/weight_sync", token)
        joined = " ".join(cmd)
        assert all(w in joined for w in want), joined
        assert "--host 127.0.0.1 --port 8123" in joined
        assert env == {var: token, **({"VLLM_SERVER_DEV_MODE": "1"} if kind == "vllm" else {})}
        assert not any(token in arg for arg in cmd), f"{kind}: the token is on the command line: {joined}"


def test_a_launched_asyncflow_serve_takes_admin_calls_only_with_its_token_and_loads_only_from_the_sync_folder(
        serve_dir: Path, tmp_path: Path) -> None:
    """Without Ray: a `ServerActor`'s `asyncflow serve` has the token in its environment (not its
    command line); without it /admin/load_weights, /admin/pause and /v1/models are 401; the run's
    engine, given the token by its server link, loads weights written to the run's weight-sync
    folder, and a folder outside it is a 403 even with the token."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from asyncflow.config import load_config
    from asyncflow.engines.http_client import HTTPError, request_json
    from asyncflow.engines.openai_engine import make_openai_engine
    from asyncflow.errors import UserError

    cfg, _ = load_config(None, ["task=arith", f"model.path={serve_dir}", "runtime.kind=ray", "rollout.engine=openai",
                                "rollout.launch_servers=asyncflow", "rollout.sync_timeout_s=60"])
    actor = _actor(serve_dir, tmp_path, serve_dir, restarts=0)
    state = AutoModelForCausalLM.from_pretrained(str(serve_dir)).state_dict()

    class Link:  # what `ServerLink` asks of the actor over Ray, in process
        async def token(self) -> str:
            return actor.client_token()

        def loaded(self, folder: Path, version: int) -> None:
            actor.loaded(str(folder), version)

    async def status(path: str, body: Any = None, token: str | None = None) -> int:
        try:
            await request_json("POST" if body is not None else "GET", f"{actor.url}{path}", body, token=token,
                               timeout=30)
            return 200
        except HTTPError as exc:
            return exc.status

    async def scenario() -> None:
        url = await actor.start()
        cmdline = Path(f"/proc/{actor.proc.pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{actor.proc.pid}/environ").read_bytes().decode().split("\0")
        assert actor.token not in cmdline and f"ASYNCFLOW_SERVE_TOKEN={actor.token}" in environ
        assert f"--weights-root\0{tmp_path / 'weight_sync'}" in cmdline
        # the rollout actor's engine in a run folder tmp_path: it writes weights to tmp_path/weight_sync
        engine = make_openai_engine(replace(cfg.rollout, server_urls=[url]), 0, serve_dir, tmp_path, session="s")
        with pytest.raises(UserError, match="HTTP 401"):  # the user's server path: no token to send
            await engine.connect()
        engine.server = Link()
        await engine.connect(state)  # version 0, written to the sync folder and loaded through the admin route
        assert (tmp_path / "weight_sync" / "v000000" / "model.safetensors").is_file()
        v0 = str(tmp_path / "weight_sync" / "v000000")
        assert await status("/admin/load_weights", {"path": v0, "version": 666}) == 401
        assert await status("/admin/pause", {}) == 401 and await status("/v1/models") == 401
        assert (await request_json("GET", f"{url}/admin/version", token=actor.token, timeout=30))["version"] == 0
        assert await status("/admin/pause", {}, actor.token) == 200
        assert await status("/admin/resume", {}, actor.token) == 200
        assert await status("/admin/load_weights", {"path": str(serve_dir), "version": 666}, actor.token) == 403
        assert await status("/admin/load_weights", {"path": v0, "version": 5}, actor.token) == 200
        await engine.close()

    try:
        asyncio.run(scenario())
    finally:
        asyncio.run(actor.stop())


def test_secret_flag_hands_an_environment_value_to_a_module_as_a_flag_never_on_the_command_line(
        tmp_path: Path) -> None:
    """The launcher of a server that takes its key only as a flag (SGLang): the module sees the flag in
    its `sys.argv` and runs as `__main__`; the process's command line and environment do not hold it."""
    (tmp_path / "fake_server.py").write_text(
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "    json.dump({'argv': sys.argv[1:], 'cmdline': cmdline, 'env': 'KEY_VAR' in os.environ},\n"
        "              open(sys.argv[1], 'w'))\n")
    token, out = "ab12" * 16, tmp_path / "seen.json"
    env = {**os.environ, "KEY_VAR": token,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent)])}
    launch = [sys.executable, "-m", "asyncflow.runtime.secret_flag", "KEY_VAR", "--api-key", "fake_server"]
    done = subprocess.run([*launch, str(out), "--port", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(out), "--port", "1", "--api-key", token]
    assert token not in seen["cmdline"] and "fake_server" in seen["cmdline"] and seen["env"] is False
    del env["KEY_VAR"]
    done = subprocess.run([*launch, str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "KEY_VAR is not set" in done.stderr


@pytest.mark.parametrize("sets, key", [
    (["rollout.launch_servers=asyncflow", "runtime.kind=local"], "rollout.launch_servers"),
    (["rollout.launch_servers=asyncflow", "rollout.server_urls=[http://127.0.0.1:8000]"], "rollout.server_urls"),
    (["rollout.launch_servers=asyncflow", "rollout.server_type=sglang"], "rollout.server_type"),
    (["rollout.launch_servers=tgi"], "rollout.launch_servers"),
    (["rollout.launch_servers=asyncflow", "rollout.server_token_env=MY_TOKEN"], "rollout.server_token_env"),
    (["rollout.server_urls=[http://127.0.0.1:8000]", "rollout.server_start_timeout_s=5"], "rollout.server_start_timeout_s"),
])
def test_launch_servers_config_errors_are_one_line_naming_the_key(sets: list[str], key: str) -> None:
    from asyncflow.config import load_config
    from asyncflow.errors import UserError

    with pytest.raises(UserError) as err:
        load_config(None, ["task=arith", "runtime.kind=ray", "rollout.engine=openai", *sets])
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)
