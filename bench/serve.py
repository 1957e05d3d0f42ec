"""HTTP serving load test: `edgeinfer serve` against llama-cpp-python's server, same run.

    python bench/serve.py [MODEL] [--threads 2] [--sizes 1 4 16 64] [--requests N]
                          [--max-output 64] [--time-limit 300] [--json] [--soak MINUTES]

Also, for edgeinfer: the concurrency-1 requests through `edgeinfer run` (no HTTP), to show the
server's overhead, and the TPOT of chats constrained by a JSON schema against the same chats
unconstrained (--no-extras skips both).

The workload is bench/throughput.py's (mixed prompt lengths, half behind a shared system
prompt; mixed output lengths with EOS banned through logit_bias, so both servers generate the
same number of tokens), sent as streamed /v1/completions at each concurrency in --sizes:
`--requests` per size (default 2 x size, at least 8), a closed loop of `size` clients. Both
servers run on 127.0.0.1 with the same GGUF file and threads; llama-cpp-python's with
`--interrupt_requests False`, so that a new request queues instead of cutting off a running
stream (its default). Each server gets a warm-up request first.

Reported as `vllm bench serve` does: completed / failed requests, output tok/s, request/s,
TTFT, TPOT = (latency - TTFT) / (tokens - 1) and ITL (time between streamed chunks), mean /
p50 / p99, and the server's peak RSS. `--soak MINUTES` instead keeps 16 streams going on
edgeinfer (after a warm-up at that load) and reports every error and the RSS: at the start,
half-way and at the end, and every 15 s. Loopback only; every loop is bounded in requests and
time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from throughput import requests as workload  # noqa: E402 - the same mixed workload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process, its URL and its peak RSS (children included), sampled every 0.2 s."""

    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str):
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench-serve-{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.peak_rss = 0
        self._stop = threading.Event()
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode}): see {self.log.name}")
            try:
                if httpx.get(self.url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            raise RuntimeError(f"{name} not ready in 900 s")
        threading.Thread(target=self._sample, daemon=True).start()

    def rss(self) -> int:
        try:
            p = psutil.Process(self.proc.pid)
            return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(True))
        except psutil.Error:
            return 0

    def _sample(self):
        while not self._stop.wait(0.2):
            self.peak_rss = max(self.peak_rss, self.rss())

    def stop(self) -> int:
        self._stop.set()
        self.proc.terminate()
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


async def one(
    http: httpx.AsyncClient, prompt, max_tokens: int, bias: dict, extra: dict | None = None
) -> dict:
    """One streamed completion (a chat when prompt is a list of messages) -> its timings."""
    chat = isinstance(prompt, list)
    body = {
        "messages" if chat else "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logit_bias": bias,
        **(extra or {}),
    }
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    stamps, finish = [], None
    try:
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": str(event["error"])[:200]}
                for c in event.get("choices", []):
                    if c.get("text") or c.get("delta", {}).get("content"):
                        stamps.append(time.perf_counter())
                    finish = c.get("finish_reason") or finish
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if not stamps:
        return {"error": "no tokens streamed"}
    # both servers stream one token per chunk here; the count is max_tokens (EOS is banned)
    tokens = max_tokens if finish == "length" else len(stamps)
    ttft = stamps[0] - t0
    return {
        "ttft": ttft,
        "latency": end - t0,
        "tokens": tokens,
        "tpot": (end - t0 - ttft) / (tokens - 1) if tokens > 1 else None,
        "itl": list(np.diff(stamps)),
    }


async def load(url: str, reqs: list[tuple[str, int]], concurrency: int, bias, limit_s: float):
    """A closed loop of `concurrency` clients over reqs, stopping new requests after limit_s."""
    results, queue = [], list(reversed(reqs))
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(limit_s + 60)) as http:

        async def client():
            while queue and time.perf_counter() - t0 < limit_s:
                prompt, m = queue.pop()
                results.append(await one(http, prompt, m, bias))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results, time.perf_counter() - t0, len(queue)


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ms = np.asarray(values) * 1e3
    return {"mean": ms.mean(), "p50": np.percentile(ms, 50), "p99": np.percentile(ms, 99)}


def summarize(results, wall: float, skipped: int, peak_rss: int) -> dict:
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "not_sent": skipped,
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "output_tok_s": out_tokens / wall,
        "req_s": len(ok) / wall,
        "ttft_ms": stats([r["ttft"] for r in ok]),
        "tpot_ms": stats([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_ms": stats([x for r in ok for x in r["itl"]]),
        "peak_rss_mib": peak_rss / 2**20,
    }


def start_edgeinfer(path: str, threads: int, ctx: int, parallel: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "edgeinfer", "serve", path, "--port", str(port)]
    cmd += ["--threads", str(threads), "--ctx", str(ctx), "--parallel", str(parallel)]
    return Server("edgeinfer", cmd, port, "/health")


def start_llama_cpp(path: str, threads: int, ctx: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    cmd += ["--n_ctx", str(ctx), "--n_gpu_layers", "0", "--interrupt_requests", "False"]
    return Server("llama-cpp-python", cmd, port, "/v1/models")


def run_server(server: Server, reqs, sizes, per_size, bias, limit_s) -> dict:
    asyncio.run(load(server.url, reqs[:1], 1, bias, limit_s))  # warm-up
    rows = {}
    for size in sizes:
        server.peak_rss = server.rss()
        n = per_size or max(8, 2 * size)
        results, wall, skipped = asyncio.run(load(server.url, reqs[:n], size, bias, limit_s))
        rows[size] = summarize(results, wall, skipped, server.peak_rss)
        print(f"  {server.name} c={size}: {rows[size]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    return rows


def soak(path: str, threads: int, reqs, ctx: int, bias, minutes: float) -> dict:
    """16 streams for `minutes` after a warm-up at the same load. The first RSS sample follows
    the warm-up; memory that only the load touches first (KV pages, batch-sized buffers) can
    still arrive after it, and a leak keeps growing: hence the timeline, and the growth over
    the second half of the run beside the growth over all of it."""
    server = start_edgeinfer(path, threads, ctx, 16)
    timeline: list[tuple[float, int]] = []
    done = threading.Event()

    def sample(start: float) -> None:
        while not done.wait(15):
            timeline.append((time.monotonic() - start, server.rss()))

    try:
        asyncio.run(load(server.url, reqs[:32], 16, bias, 300))
        rss_start = server.rss()
        reqs_forever = reqs * (1 + int(minutes * 60))  # never runs out before the time does
        sampler = threading.Thread(target=sample, args=(time.monotonic(),), daemon=True)
        sampler.start()
        results, wall, _ = asyncio.run(load(server.url, reqs_forever, 16, bias, minutes * 60))
        done.set()
        sampler.join()
        rss_end = server.rss()
    finally:
        done.set()
        code = server.stop()
    half = [rss for t, rss in timeline if t <= minutes * 30] or [rss_start]
    summary = summarize(results, wall, 0, server.peak_rss)
    summary.update(
        minutes=minutes,
        rss_start_mib=rss_start / 2**20,
        rss_half_mib=half[-1] / 2**20,
        rss_end_mib=rss_end / 2**20,
        rss_growth_pct=100 * (rss_end - rss_start) / rss_start,
        rss_growth_second_half_pct=100 * (rss_end - half[-1]) / half[-1],
        rss_timeline_mib=[(round(t), round(rss / 2**20, 1)) for t, rss in timeline],
        exit_code=code,
    )
    return summary


def run_baseline(path: str, threads: int, reqs, ctx: int) -> dict:
    """The c=1 requests through `edgeinfer run` (no HTTP): output tok/s over TTFT + decode."""
    tokens, seconds = 0, 0.0
    for prompt, m in reqs:
        cmd = [sys.executable, "-m", "edgeinfer", "run", path, "-p", prompt, "-n", str(m)]
        cmd += ["--temp", "0", "--ignore-eos", "--json", "--threads", str(threads)]
        cmd += ["--ctx", str(ctx)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        metrics = json.loads(out.stdout)["metrics"]
        tokens += metrics["generated_tokens"]
        seconds += metrics["ttft_s"] + metrics["decode_s"]
    return {"requests": len(reqs), "output_tok_s": tokens / seconds}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}},
    },
    "required": ["name", "age", "city", "hobbies"],
}


def json_schema_cost(server: Server, n: int, max_tokens: int) -> dict:
    """TPOT of chats constrained by a JSON schema against the same chats unconstrained."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chats = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(n)
    ]

    async def go(extra):
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
            return [await one(http, c, max_tokens, {}, extra) for c in chats]

    asyncio.run(go({"response_format": fmt}))  # warm-up: the grammar compiler
    plain = [r for r in asyncio.run(go({"ignore_eos": True})) if "error" not in r]
    masked = [r for r in asyncio.run(go({"response_format": fmt})) if "error" not in r]

    def tpot(rs):
        return float(np.mean([r["tpot"] for r in rs if r["tpot"]])) * 1e3

    return {
        "requests": n,
        "tpot_plain_ms": tpot(plain),
        "tpot_json_schema_ms": tpot(masked),
        "overhead_pct": 100 * (tpot(masked) / tpot(plain) - 1),
    }


def context(token_reqs) -> int:
    """The context every request fits: its prompt tokens plus its output, plus a margin."""
    return max(len(p) + m for p, m in token_reqs) + 16


def markdown(report: dict) -> str:
    lines = [
        f"model {report['model']}, {report['threads']} threads, streamed /v1/completions, "
        f"greedy, EOS banned",
        "",
        "| server | conc. | done | failed | not sent | out tok/s | req/s | TTFT mean/p50/p99 ms "
        "| TPOT mean/p50/p99 ms | ITL mean/p50/p99 ms | peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(d):
        return "/".join("-" if d[k] is None else f"{d[k]:.0f}" for k in ("mean", "p50", "p99"))

    for size in report["sizes"]:
        for name in ("edgeinfer", "llama-cpp-python"):
            r = report["servers"].get(name, {}).get(size)
            if r is None:
                continue
            lines.append(
                f"| {name} | {size} | {r['completed']} | {r['failed']} | {r['not_sent']} "
                f"| {r['output_tok_s']:.1f} | {r['req_s']:.2f} | {f(r['ttft_ms'])} "
                f"| {f(r['tpot_ms'])} | {f(r['itl_ms'])} | {r['peak_rss_mib']:.0f} |"
            )
        ours = report["servers"].get("edgeinfer", {}).get(size)
        theirs = report["servers"].get("llama-cpp-python", {}).get(size)
        if ours and theirs and theirs["output_tok_s"]:
            ratio = ours["output_tok_s"] / theirs["output_tok_s"]
            lines.append(f"| ratio | {size} | | | | {ratio:.2f}x | | | | | |")
    base, http1 = report.get("run_c1"), report["servers"].get("edgeinfer", {}).get(1)
    if base and http1:
        lines += [
            "",
            f"server overhead at concurrency 1: HTTP {http1['output_tok_s']:.1f} tok/s, "
            f"`edgeinfer run` {base['output_tok_s']:.1f} tok/s "
            f"({http1['output_tok_s'] / base['output_tok_s']:.2f}x)",
        ]
    js = report.get("json_schema")
    if js:
        lines.append(
            f"json_schema masking: TPOT {js['tpot_json_schema_ms']:.1f} ms against "
            f"{js['tpot_plain_ms']:.1f} ms unconstrained ({js['overhead_pct']:+.1f} %)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=None, help="per size (2 x size, >= 8)")
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=300, help="seconds per size and server")
    ap.add_argument("--only", choices=["edgeinfer", "llama-cpp-python"], default=None)
    ap.add_argument("--soak", type=float, default=None, metavar="MINUTES")
    ap.add_argument("--no-extras", action="store_true", help="skip the run and json checks")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from edgeinfer.gguf.hub import resolve_model
    from edgeinfer.tokenizer.tokenizer import Tokenizer

    path = str(resolve_model(args.model))
    tok = Tokenizer.from_gguf(path)
    n = max(args.requests or 0, 2 * max(args.sizes), 8)
    token_reqs = workload(tok, args.max_output, n)
    reqs = [(tok.decode(p), m) for p, m in token_reqs]
    ctx = context(token_reqs)
    bias = {str(t): -100 for t in sorted(tok.eos_ids)}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.soak is not None:
        result = soak(path, args.threads, reqs, ctx, bias, args.soak)
        print(json.dumps(result, indent=1, default=float))
        return

    report = {"model": args.model, "threads": args.threads, "sizes": args.sizes, "servers": {}}
    starts = {
        "edgeinfer": lambda: start_edgeinfer(path, args.threads, ctx, max(args.sizes)),
        "llama-cpp-python": lambda: start_llama_cpp(path, args.threads, ctx),
    }
    for name, start in starts.items():
        if args.only not in (None, name):
            continue
        server = start()
        try:
            report["servers"][name] = run_server(
                server, reqs, args.sizes, args.requests, bias, args.time_limit
            )
            if name == "edgeinfer" and not args.no_extras:
                report["json_schema"] = json_schema_cost(server, 8, args.max_output)
        finally:
            server.stop()
    if 1 in args.sizes and "edgeinfer" in report["servers"] and not args.no_extras:
        n = args.requests or 8
        report["run_c1"] = run_baseline(path, args.threads, reqs[:n], ctx)
    if args.json:
        print(json.dumps(report, indent=1, default=float))
    else:
        print(markdown(report))


if __name__ == "__main__":
    main()
