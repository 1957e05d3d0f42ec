"""What one decode step of n sequences costs against a step of one: edgeinfer and llama.cpp.

    python bench/batch_decode.py [MODEL ...] [--threads N] [--sizes 1 4 16] [--steps 24] [--json]

Batched decode shares each weight read between the sequences of a step, so a step of n costs
less than n steps of one; how much less is bounded by the arithmetic the cores can do once the
weights are no longer the bottleneck. Per model and n: n sequences each get the same 64-token
prompt shape, then `--steps` steps decode one token for every sequence at once; reported is
the fastest step (ms) and its ratio to n = 1, for edgeinfer (one runner pass over a token of
each sequence, the fastest kernels for the batch size, as the engine's decode steps) and for
llama.cpp (llama-cpp-python's low-level `llama_decode`, one batch holding a token of each
sequence), both on the same GGUF file with the same threads, in this process, one after the
other.
"""

from __future__ import annotations

import argparse
import json
import time

import llama_cpp

from edgeinfer.gguf import hub
from edgeinfer.llm import LLM

PROMPT = 64
MAX_SEQS = 16
CTX_PER_SEQ = 256


def _prompt(seq: int) -> list[int]:
    return [100 + (seq * 7 + j) % 1000 for j in range(PROMPT)]


def edgeinfer_steps(path, sizes, steps: int, threads: int) -> dict[int, float]:
    engine = LLM(str(path), threads=threads, ctx=CTX_PER_SEQ, parallel=max(sizes)).engine
    scheduler = engine.scheduler
    best = {}
    for n in sizes:
        for s in range(n):
            engine.forward(s, _prompt(s))
        times = []
        for k in range(steps):
            t0 = time.perf_counter()
            chunks = [scheduler.extend(s, [200 + s + k], scheduler.seq_len(s)) for s in range(n)]
            engine.runner.execute(chunks, row_wise=False)
            times.append(time.perf_counter() - t0)
        for s in range(n):
            engine.release(s)
        best[n] = min(times)
    return best


def llama_steps(path, sizes, steps: int, threads: int) -> dict[int, float]:
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(path).encode(), llama_cpp.llama_model_default_params()
    )
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max = CTX_PER_SEQ * MAX_SEQS, MAX_SEQS
    params.n_batch = params.n_ubatch = PROMPT
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(PROMPT, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        # items: (token, position, sequence, wants logits)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(items)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    best = {}
    try:
        for n in sizes:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            for s in range(n):
                decode([(t, j, s, j == PROMPT - 1) for j, t in enumerate(_prompt(s))])
            times = []
            for k in range(steps):
                t0 = time.perf_counter()
                decode([(200 + s + k, PROMPT + k, s, True) for s in range(n)])
                times.append(time.perf_counter() - t0)
            best[n] = min(times)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not all(1 <= n <= MAX_SEQS for n in args.sizes) or 1 not in args.sizes:
        ap.error(f"--sizes must include 1 and stay within 1..{MAX_SEQS}")
    if args.steps < 1 or args.steps + PROMPT > CTX_PER_SEQ:
        ap.error(f"--steps must be 1..{CTX_PER_SEQ - PROMPT}")
    sizes = sorted(set(args.sizes))
    rows = []
    for name in args.models:
        path = hub.resolve_model(name)
        ours = edgeinfer_steps(path, sizes, args.steps, args.threads)
        ref = llama_steps(path, sizes, args.steps, args.threads)
        for n in sizes:
            rows.append(
                {
                    "model": name,
                    "n": n,
                    "edgeinfer_ms": ours[n] * 1e3,
                    "edgeinfer_vs_n1": ours[n] / ours[1],
                    "llama_cpp_ms": ref[n] * 1e3,
                    "llama_cpp_vs_n1": ref[n] / ref[1],
                }
            )
    if args.json:
        print(json.dumps({"threads": args.threads, "results": rows}))
        return
    print(f"| model | n | edgeinfer ms (x n=1) | llama.cpp ms (x n=1) |  ({args.threads} threads)")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['model']} | {r['n']} | {r['edgeinfer_ms']:.2f} ({r['edgeinfer_vs_n1']:.2f}x) "
            f"| {r['llama_cpp_ms']:.2f} ({r['llama_cpp_vs_n1']:.2f}x) |"
        )


if __name__ == "__main__":
    main()
