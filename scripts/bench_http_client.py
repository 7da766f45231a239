"""HTTP client before/after: `asyncflow serve` (tiny arith model) on loopback, over http and https.

    python scripts/bench_http_client.py [BEFORE_REV]   (default: the commit before the pooled client)

`asyncflow serve` closes every connection after its reply and speaks no TLS, so the https rows (and
the keep-alive http rows) go through a TLS-terminating, keep-alive proxy in a child process (what a
vLLM/SGLang server behind uvicorn, or a load balancer, looks like to the client); the proxy forwards
each request to the server on a new connection. Per row: requests/s, p50 latency, and the time the
client's event loop was blocked per request (a 1 ms ticker's accumulated lateness).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 1, "temperature": 1.0}
TOKEN = "bench-token"


def start_server(folder: Path) -> tuple[subprocess.Popen[str], str]:
    from asyncflow.tasks.arith import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model(tok, seed=0, hidden=64).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow", "serve", str(folder), "--port", "0", "--token", TOKEN],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line, deadline = "", time.monotonic() + 180
    while "listening on" not in line and time.monotonic() < deadline and proc.poll() is None:
        line = (proc.stdout.readline() if proc.stdout else "") or line
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, line.split("listening on ")[1].split()[0]


async def proxy(backend: str, cert: str, key: str, tls: bool) -> None:
    """Keep-alive (and TLS) in front of a one-request-per-connection server."""
    from asyncflow.engines.http_client import read_headers

    host, port = backend.split("://")[1].rstrip("/").rsplit(":", 1)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                head = await read_headers(reader)
                body = await reader.readexactly(int(head.get("content-length", "0")))
                br, bw = await asyncio.open_connection(host, int(port))
                lines = [line.decode().strip()] + [f"{k}: {v}" for k, v in head.items() if k != "connection"]
                bw.write(("\r\n".join([*lines, "Connection: close"]) + "\r\n\r\n").encode() + body)
                status = await br.readline()
                rhead = await read_headers(br)
                rbody = await br.readexactly(int(rhead["content-length"]))
                bw.close()
                out = [status.decode().strip()] + [f"{k}: {v}" for k, v in rhead.items() if k != "connection"]
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + rbody)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    ctx = None
    if tls:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx, backlog=512)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.sleep(3600)


def old_client(rev: str) -> types.ModuleType:
    src = subprocess.run(["git", "show", f"{rev}:asyncflow/engines/http_client.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType("http_client_before")
    exec(compile(src, "http_client_before.py", "exec"), mod.__dict__)  # noqa: S102 (our own past revision)
    return mod


async def measure(client: types.ModuleType, url: str, concurrency: int, total: int) -> dict[str, float]:
    lateness, ticking = [0.0, 0.0], True

    async def ticker() -> None:
        while ticking:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            late = time.perf_counter() - t - 0.001
            lateness[0] += max(late, 0.0)
            lateness[1] = max(lateness[1], late)

    latencies: list[float] = []

    async def worker(n: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            await client.request_json("POST", f"{url}/v1/completions", BODY, token=TOKEN, timeout=60)
            latencies.append(time.perf_counter() - t)

    await client.request_json("POST", f"{url}/v1/completions", BODY, token=TOKEN, timeout=60)  # warm-up
    tick = asyncio.ensure_future(ticker())
    start = time.perf_counter()
    await asyncio.gather(*(worker(total // concurrency) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ticking = False
    await tick
    if hasattr(client, "close_pool"):
        await client.close_pool()
    n = len(latencies)
    return {"rps": n / wall, "p50_ms": statistics.median(latencies) * 1e3,
            "loop_ms_per_req": lateness[0] / n * 1e3, "max_stall_ms": lateness[1] * 1e3}


def main() -> None:
    rev = sys.argv[1] if len(sys.argv) > 1 else "8f7f399~1"
    sys.path.insert(0, str(ROOT))
    from asyncflow.engines import http_client as after

    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    os.environ["SSL_CERT_FILE"] = str(cert)
    server, url = start_server(tmp / "tiny")
    proxies, targets = [], {"http direct (server closes)": url}
    try:
        for tls in (False, True):
            p = subprocess.Popen([sys.executable, __file__, "--proxy", url, str(cert), str(key), str(int(tls))],
                                 stdout=subprocess.PIPE, text=True)
            proxies.append(p)
            port = int(p.stdout.readline()) if p.stdout else 0
            targets[f"{'https' if tls else 'http'} keep-alive proxy"] = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        before = old_client(rev)
        print("| target | client | mode | req/s | p50 ms | loop blocked ms/req | max stall ms |")
        print("|---|---|---|---|---|---|---|")
        for name, target in targets.items():
            for mode, conc, total in (("sequential", 1, 200), ("64 concurrent", 64, 640)):
                for label, client in (("before", before), ("after", after)):
                    r = asyncio.run(measure(client, target, conc, total))
                    print(f"| {name} | {label} | {mode} | {r['rps']:.0f} | {r['p50_ms']:.1f} | "
                          f"{r['loop_ms_per_req']:.2f} | {r['max_stall_ms']:.1f} |", flush=True)
    finally:
        for p in [*proxies, server]:
            p.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--proxy"]:
        sys.path.insert(0, str(ROOT))
        asyncio.run(proxy(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"))
    else:
        main()
