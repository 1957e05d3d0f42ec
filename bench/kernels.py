"""Kernel benchmark: matmul throughput per registered GGML type against the measured read bandwidth.

    python bench/kernels.py [--json] [--threads N] [--types Q4_0,Q8_0] [--ns 1,4,16,512]
                            [--rounds 3]

For every type: a random weight of >= --mb MB (bigger than L3, so it streams from RAM),
y = x · Wᵀ for each n; GB/s = weight bytes / time, % of the bandwidth measured in the same run
with all threads (bench/bandwidth.py), GFLOP/s = 2·n·out·in / time; at n = 512
also numpy's float32 matmul FLOP rate on the same shape, and the prompt rows' two row-wise paths
(the float row tiles of --precision exact, the int8 GEMM of fast where the type takes it).
Best of several repeats, and best of --rounds passes over all the types (the bandwidth too,
measured again each pass): on a shared machine a slow spell otherwise lands on whichever types
ran during it. Then the cold JIT compile time of every kernel (fresh NUMBA_CACHE_DIR, in a
subprocess) and the warm start with that cache. `--json` prints exactly one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
from bandwidth import read_bandwidth  # bench/, the script's folder
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from threadpoolctl import threadpool_limits

from edgeinfer import kernels

COLS = 4096
# Byte offsets of each type's float16 scale fields in a block: random bytes there are replaced
# by sane scales (random halves would give inf/NaN and slow subnormal arithmetic).
T = GGMLQuantizationType
SCALE_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}  # fmt: skip


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def random_weight(qtype: GGMLQuantizationType, min_mb: int, rng) -> kernels.QuantWeight:
    block, size = GGML_QUANT_SIZES[qtype]
    row_bytes = COLS // block * size
    rows = max(64, -(-(min_mb << 20) // row_bytes))
    rows += -rows % 64
    if qtype in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((rows, COLS), dtype=np.float32)
        if qtype == T.F16:
            w = w.astype(np.float16)
        elif qtype == T.BF16:
            w = (w.view(np.uint32) >> 16).astype(np.uint16)
        raw = w.view(np.uint8).reshape(-1)
    else:
        raw = rng.integers(0, 256, size=(rows * COLS // block, size), dtype=np.uint8)
        for off in SCALE_FIELDS[qtype]:
            h = (rng.random(raw.shape[0], dtype=np.float32) * 0.01 + 1e-3).astype(np.float16)
            raw[:, off : off + 2] = h.view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(-1)
    return kernels.QuantWeight.from_raw(raw, qtype, (rows, COLS))


def bench_type(qtype, ns, min_mb, bandwidth, rng) -> list[dict]:
    w = random_weight(qtype, min_mb, rng)
    rows, cols = w.shape
    results = []
    for n in ns:
        x = rng.standard_normal((n, cols), dtype=np.float32)
        t = best_time(lambda x=x: kernels.matmul(x, w), 5 if n <= 16 else 2)
        gbs = w.nbytes / t / 1e9
        r = {
            "type": qtype.name,
            "n": n,
            "gbs": round(gbs, 2),
            "pct_bandwidth": round(100 * gbs / bandwidth, 1),
            "gflops": round(2 * n * rows * cols / t / 1e9, 2),
            "ms": round(t * 1e3, 3),
        }
        if n >= 128:
            wf = kernels.dequantize(w.raw, qtype, w.shape)
            # numpy as a user would run it: BLAS with all the threads
            with threadpool_limits(limits=kernels.get_threads(), user_api="blas"):
                tb = best_time(lambda x=x, wf=wf: x @ wf.T, 2)
            del wf
            r["numpy_f32_gflops"] = round(2 * n * rows * cols / tb / 1e9, 2)
            r["pct_numpy"] = round(100 * tb / t, 1)
            paths = {"rows_f32": kernels.bind_row_wise([w], exact=True)}
            if w.unit.int8_faster:
                paths["rows_int8"] = kernels.bind_row_wise([w], int8=True)
            for label, call in paths.items():
                tr = best_time(lambda x=x, call=call: call(x), 2)
                r[f"{label}_gflops"] = round(2 * n * rows * cols / tr / 1e9, 2)
        results.append(r)
    return results


def best_of_rounds(rounds: list[list[dict]], bandwidth: float) -> list[dict]:
    """Per (type, n), the round with the fastest kernel (and numpy's fastest round), its share
    of `bandwidth` (the best measured)."""
    best = []
    for runs in zip(*rounds, strict=True):
        r = dict(min(runs, key=lambda r: r["ms"]))
        for key in ("rows_f32_gflops", "rows_int8_gflops"):
            if key in r:
                r[key] = max(x[key] for x in runs)
        r["pct_bandwidth"] = round(100 * r["gbs"] / bandwidth, 1)
        numpy = [x["numpy_f32_gflops"] for x in runs if "numpy_f32_gflops" in x]
        if numpy:
            r["numpy_f32_gflops"] = max(numpy)
            r["pct_numpy"] = round(100 * r["gflops"] / max(numpy), 1)
        best.append(r)
    return best


def compile_probe() -> None:
    """Run every kernel once on tiny inputs; print seconds since this process started.

    Run in a subprocess with its own NUMBA_CACHE_DIR: empty = cold compile, filled = warm start.
    """
    rng = np.random.default_rng(0)
    for qtype in kernels.supported_types():
        w = random_weight(qtype, 0, rng)
        for n in (1, 64):  # the fused small-n kernel and, for most types, the tiled BLAS path
            kernels.matmul(np.ones((n, COLS), np.float32), w)
        if w.unit.matmul_int8 is not None:  # the prompt rows' int8 GEMM
            x = np.ones((4, COLS), np.float32)
            w.unit.matmul_int8(w.row_parts, x, np.empty((4, w.shape[0]), np.float32))
        kernels.embedding(w, [0, 3])
    print(time.time() - psutil.Process().create_time())


def compile_times() -> dict:
    """Wall seconds to "every kernel ran once" in a fresh process, and the CPU seconds it used
    (the steadier figure on a shared machine): cold = empty Numba cache, warm = cache filled."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("cold_compile", "warm_start"):
            cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            run = subprocess.run(
                [sys.executable, __file__, "--compile-probe"],
                env=env, check=True, capture_output=True, text=True,
            )  # fmt: skip
            cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
            out[f"{label}_s"] = round(float(run.stdout.split()[-1]), 2)
            out[f"{label}_cpu_s"] = round(cpu, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--threads", type=int, default=None, help="default: physical cores")
    ap.add_argument("--types", default=None, help="comma-separated GGML type names")
    ap.add_argument("--ns", default="1,4,16,512")
    ap.add_argument("--mb", type=int, default=64, help="minimum weight size in MB")
    ap.add_argument("--rounds", type=int, default=3, help="passes over all the types")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-time probe")
    ap.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compile_probe:
        compile_probe()
        return
    threads = kernels.set_threads(args.threads)
    types = (
        [kernels.registry.as_qtype(t) for t in args.types.split(",")]
        if args.types
        else kernels.supported_types()
    )
    ns = [int(n) for n in args.ns.split(",")]
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rng = np.random.default_rng(0)
    rounds, bandwidths = [], []
    for _ in range(args.rounds):
        bandwidths.append(read_bandwidth(kernels.threads.apply()) / 1e9)
        rounds.append([r for q in types for r in bench_type(q, ns, args.mb, bandwidths[-1], rng)])
    bandwidth = max(bandwidths)
    results = best_of_rounds(rounds, bandwidth)
    if not args.json:
        for r in results:
            print(
                f"{r['type']:6} n={r['n']:<4} {r['gbs']:7.2f} GB/s "
                f"{r['pct_bandwidth']:6.1f} % bw "
                f"{r['gflops']:8.2f} GFLOP/s {r['ms']:9.2f} ms"
                + (
                    f"  numpy f32 {r['numpy_f32_gflops']:.1f} GFLOP/s ({r['pct_numpy']} %)"
                    if "pct_numpy" in r
                    else ""
                )
                + "".join(
                    f"  {key[:-7]} {r[key]:.1f}"
                    for key in ("rows_f32_gflops", "rows_int8_gflops")
                    if key in r
                ),
                flush=True,
            )
    report = {
        "bandwidth_gbs": round(bandwidth, 2),
        "bandwidth_gbs_by_round": [round(b, 2) for b in bandwidths],
        "threads": threads,
        "results": results,
    }
    if not args.no_compile:
        report["compile"] = compile_times()
    if args.json:
        print(json.dumps(report))
    else:
        by_round = ", ".join(f"{b:.2f}" for b in bandwidths)
        print(f"read bandwidth {bandwidth:.2f} GB/s with {threads} threads (rounds: {by_round})")
        if "compile" in report:
            print("compile:", report["compile"])


if __name__ == "__main__":
    main()
