"""Layers on ggml RPC servers: prefill and decode tok/s all-local against a split over two
loopback `edgeinfer rpc-server`s, with the network round trips and bytes per decoded token
counted on the wire, and llama.cpp's own RPC split of the same file in the same run.

    python bench/rpc.py [--models smollm2-135m-instruct,llama-1b-q4_k_m] [--threads 2]
                        [--prompt 128] [--tokens 32] [--repeats 3] [--json]

The split: every layer and the head over servers A and B, half each (edgeinfer: `--rpc A,B`
with both servers reporting the same memory; llama.cpp: n_gpu_layers 99 over the same two RPC
devices, tensor_split 1:1, through the RPC module `make rpc` builds, loaded into
llama-cpp-python's ggml; its layer boundary may differ from ours by one layer). llama.cpp runs
in a child process: ggml's client keeps its connections for the life of the process, and a
server serves one client at a time. Wire counts go through a counting TCP proxy in a separate
pass (the proxy's own latency stays out of the tok/s): per decoded token, the difference between
generating `tokens` and `2 * tokens` tokens, divided by `tokens`, so loading and the prompt
cancel out. A round trip is the client sending and then the server answering. Loopback only:
the README turns the round trips into a throughput model for a real network. Name a model by a
short name or path, or by a bench/synth.py name (llama-1b-q4_k_m: ~1.2B parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int) -> tuple[subprocess.Popen, str]:
    from edgeinfer.ggml.rpc import RPCError, probe

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgeinfer", "rpc-server", "--port", str(port), "--threads",
         str(threads), "--mem", "16G"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"127.0.0.1:{port}"
    for _ in range(600):
        try:
            probe(endpoint, timeout=2)
            return proc, endpoint
        except RPCError:
            if proc.poll() is not None:
                raise SystemExit("edgeinfer rpc-server did not start (make rpc?)") from None
            time.sleep(0.1)
    raise SystemExit("edgeinfer rpc-server did not answer")


class CountingProxy:
    """127.0.0.1:port -> upstream, counting bytes each way and round trips (a client send
    followed by a server answer)."""

    def __init__(self, upstream: str):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.up = self.down = self.round_trips = 0
        self._last = "down"
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def counts(self) -> tuple[int, int, int]:
        with self._lock:
            return self.up, self.down, self.round_trips

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while data := src.recv(1 << 20):
                with self._lock:
                    if way == "up":
                        self.up += len(data)
                    else:
                        self.down += len(data)
                        if self._last == "up":
                            self.round_trips += 1
                    self._last = way
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def release(llm) -> None:
    """Close a split's worker now: each server serves one client at a time."""
    if llm._runner.executor is not None:
        llm._runner.executor.close()


def prompt_tokens(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, vocab - 100, n).tolist()


def bench_edgeinfer(path, knobs, threads, prompt, tokens, repeats) -> dict:
    from edgeinfer.engine.sampling import SamplingParams
    from edgeinfer.llm import LLM

    llm = LLM(str(path), threads=threads, ctx=len(prompt) + 2 * tokens + 16,
              prefix_caching=False, **knobs)  # fmt: skip
    try:
        llm.generate(prompt[:32], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        runs = [llm.generate(prompt, params)[0].metrics for _ in range(repeats)]
        return {
            "prefill_tok_s": statistics.median(m.prefill_tok_s for m in runs),
            "decode_tok_s": statistics.median(m.decode_tok_s for m in runs),
            "placement": llm.placement(),
        }
    finally:
        release(llm)


def wire_edgeinfer(path, servers, threads, prompt, tokens) -> dict:
    """Bytes and round trips per decoded token, through counting proxies."""
    from edgeinfer.engine.sampling import SamplingParams
    from edgeinfer.llm import LLM

    proxies = [CountingProxy(s) for s in servers]
    try:
        rpc = ",".join(p.endpoint for p in proxies)
        llm = LLM(str(path), threads=threads, ctx=len(prompt) + 2 * tokens + 16,
                  prefix_caching=False, rpc=rpc)  # fmt: skip
        # once first: a graph's first step sends it whole and asks its buffers' sizes
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        totals = []
        for n in (tokens, 2 * tokens):
            before = [p.counts() for p in proxies]
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            after = [p.counts() for p in proxies]
            totals.append(np.sum(np.array(after) - np.array(before), axis=0))
        release(llm)
        return per_token(totals, tokens)
    finally:
        for p in proxies:
            p.close()


def per_token(totals: list, tokens: int) -> dict:
    up, down, trips = (totals[1] - totals[0]) / tokens
    return {"bytes_up": float(up), "bytes_down": float(down), "round_trips": float(trips)}


def llama_child(args) -> None:
    """In a child process: llama.cpp over the given RPC servers (or none) -> one JSON line."""
    import llama_cpp
    from offload import time_llama

    from edgeinfer.ggml.backends import rpc_function
    from edgeinfer.ggml.lib import load

    kw = {}
    if args.endpoints:
        import ctypes as C

        lib = load()
        add = rpc_function("ggml_backend_rpc_add_server", C.c_void_p, C.c_char_p)
        for ep in args.endpoints.split(","):
            reg = add(ep.encode())
            for i in range(lib.ggml_backend_reg_dev_count(reg)):
                lib.ggml_backend_device_register(lib.ggml_backend_reg_dev_get(reg, i))
        n = len(args.endpoints.split(","))
        kw = {"n_gpu_layers": 99, "tensor_split": [1.0] * n}
    else:
        kw = {"n_gpu_layers": 0}
    prompt = json.loads(args.prompt_ids)
    llm = llama_cpp.Llama(model_path=args.llama_child, n_ctx=len(prompt) + 2 * args.tokens + 16,
                          n_threads=args.threads, verbose=False, **kw)  # fmt: skip
    print(json.dumps(time_llama(llm, prompt, args.tokens, args.repeats)))


def run_llama(path, endpoints: list[str], threads, prompt, tokens, repeats) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--llama-child", str(path), "--threads",
           str(threads), "--tokens", str(tokens), "--repeats", str(repeats), "--prompt-ids",
           json.dumps(prompt), "--endpoints", ",".join(endpoints)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"llama.cpp's RPC split failed: {tail}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def wire_llama(path, servers, threads, prompt, tokens) -> dict:
    proxies = [CountingProxy(s) for s in servers]
    try:
        totals = []
        for n in (tokens, 2 * tokens):
            before = [p.counts() for p in proxies]
            r = run_llama(path, [p.endpoint for p in proxies], threads, prompt, n, 1)
            if "error" in r:
                return r
            time.sleep(0.2)  # the proxies' last bytes
            totals.append(np.sum(np.array([p.counts() for p in proxies]) - np.array(before),
                                 axis=0))  # fmt: skip
        return per_token(totals, tokens)
    finally:
        for p in proxies:
            p.close()


def resolve(name: str) -> Path:
    sys.path.insert(0, str(HERE))
    from synth import MODELS, model_path

    from edgeinfer.gguf.hub import resolve_model

    return model_path(name) if name in MODELS else resolve_model(name)


def bench_model(name, servers, args) -> dict:
    from edgeinfer.gguf.model_config import ModelConfig
    from edgeinfer.gguf.reader import read_gguf

    path = resolve(name)
    with read_gguf(path) as g:
        vocab = ModelConfig.from_gguf(g).vocab_size
    prompt = prompt_tokens(vocab, args.prompt, 0)
    t, c, n, r = args.threads, args.client_threads, args.tokens, args.repeats
    rpc = {"rpc": ",".join(servers)}
    row = {
        "model": str(path),
        "edgeinfer local": bench_edgeinfer(path, {}, t, prompt, n, r),
        "edgeinfer rpc": bench_edgeinfer(path, rpc, c, prompt, n, r),
        "llama.cpp local": run_llama(path, [], t, prompt, n, r),
        "llama.cpp rpc": run_llama(path, servers, c, prompt, n, r),
    }
    row["edgeinfer rpc"]["wire"] = wire_edgeinfer(path, servers, c, prompt, n)
    if "error" not in row["llama.cpp rpc"]:
        row["llama.cpp rpc"]["wire"] = wire_llama(path, servers, c, prompt, n)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m-instruct,llama-1b-q4_k_m")
    ap.add_argument("--threads", type=int, default=2, help="all-local runs and each server")
    ap.add_argument(
        "--client-threads", type=int, default=1,
        help="the client of a split (it only embeds and samples; on a small box its idle "
        "threads would take the servers' cores)",
    )  # fmt: skip
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--llama-child", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_child:
        return llama_child(args)
    load = os.getloadavg()[0]
    procs, servers = zip(*(start_server(args.threads) for _ in range(2)), strict=True)
    try:
        rows = [bench_model(m, list(servers), args) for m in args.models.split(",")]
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    result = {"threads": args.threads, "client_threads": args.client_threads,
              "prompt_tokens": args.prompt, "tokens": args.tokens, "load_avg_1m_at_start": load,
              "load_avg_1m_at_end": os.getloadavg()[0], "cpus": psutil.cpu_count(),
              "rows": rows}  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.threads} threads (local runs and each server; a split's client "
          f"{args.client_threads}), prompt {args.prompt}, "
          f"{args.tokens} generated; load average {load:.1f} -> {os.getloadavg()[0]:.1f} on "
          f"{psutil.cpu_count()} CPUs; two servers on loopback")  # fmt: skip
    for row in rows:
        print(f"\n{Path(row['model']).name}")
        print(f"{'':<17}{'pp tok/s':>9}{'tg tok/s':>9} | {'trips/tok':>9}{'up B/tok':>10}"
              f"{'down B/tok':>11}")  # fmt: skip
        for key in ("edgeinfer local", "edgeinfer rpc", "llama.cpp local", "llama.cpp rpc"):
            r = row[key]
            if "error" in r:
                print(f"{key:<17}{r['error']}")
                continue
            w = r.get("wire")
            wire = (f"{w['round_trips']:>9.1f}{w['bytes_up']:>10.0f}{w['bytes_down']:>11.0f}"
                    if w and "error" not in w else f"{'-':>9}{'-':>10}{'-':>11}")  # fmt: skip
            print(f"{key:<17}{r['prefill_tok_s']:>9.1f}{r['decode_tok_s']:>9.1f} | {wire}")
        ours, ref = row["edgeinfer rpc"], row["llama.cpp rpc"]
        if "error" not in ref:
            ratio = ours["decode_tok_s"] / ref["decode_tok_s"]
            print(f"decode, edgeinfer's split / llama.cpp's split: {ratio:.2f}x")
            w0, w1 = ours.get("wire"), ref.get("wire")
            if w0 and w1 and "error" not in w1:
                b0, b1 = w0["bytes_up"] + w0["bytes_down"], w1["bytes_up"] + w1["bytes_down"]
                print(f"bytes per decoded token, edgeinfer / llama.cpp: {b0 / b1:.2f}x")
        print(f"edgeinfer placement: {ours['placement']}")


if __name__ == "__main__":
    main()
