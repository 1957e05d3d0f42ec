"""Serving throughput: edgeinfer's continuous batching against llama-cpp-python one by one.

    python bench/throughput.py [MODEL] [--threads N] [--sizes 1 4 16 64] [--max-output 256]
                               [--rounds 2] [--json]

A fixed list of greedy requests with mixed prompt lengths (half of them behind a shared
system prompt, as chat traffic is) and mixed output lengths (EOS ignored, so every engine
generates the same number of tokens). For each N in --sizes, the first N requests arrive
together and edgeinfer serves them concurrently; reported: aggregate output tok/s (output
tokens / time until the last one finishes), TTFT and TPOT p50 / p99, peak KV blocks, and
whether each request's tokens are identical to the same request run alone on edgeinfer
(both in batch-invariant mode, which is what makes them identical).
In the same run, llama-cpp-python (in its own process, same threads) serves the same requests
one after another through its high-level API, keeping its own prompt-prefix reuse. The engines
take turns, `--rounds` times each (A B, B A, ...), and each reports its best round: on a shared
machine a slow spell otherwise lands on whichever engine ran during it.
Last, a chat's second turn: its TTFT with prefix caching against recomputing the history.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

PROSE = (
    "The history of computing is a story of machines that grew smaller, faster and cheaper. "
    "Early computers filled rooms and consumed enormous amounts of power, yet they performed "
    "fewer operations per second than a modern wristwatch. Over the decades, engineers learned "
    "to pack more transistors onto silicon, and programmers learned to make them do more work. "
)
SYSTEM_TOKENS = 96
N_REQUESTS = 64


def requests(
    tokenizer, max_output: int, n: int = N_REQUESTS, seed: int = 0
) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output tokens): prompts of 8-400 tokens (plus a 96-token system
    prompt for every other one), outputs of 16-max_output tokens."""
    rng = np.random.default_rng(seed)
    words = PROSE.split()
    system = tokenizer.encode(" ".join(words * 4))[:SYSTEM_TOKENS]
    out = []
    for i in range(n):
        start = int(rng.integers(0, len(words)))
        text = " ".join((words[start:] + words) * 8)
        body = tokenizer.encode(text, add_bos=False)[: int(rng.integers(8, 400))]
        prompt = system + body if i % 2 else (system[:1] + body)
        out.append((prompt, int(rng.integers(16, max_output + 1))))
    return out


def pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def serve(llm, reqs) -> dict:
    """All of reqs arrive now; step the engine until every one is done."""
    from edgeinfer import SamplingParams
    from edgeinfer.engine.outputs import Completion

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    t0 = time.perf_counter()
    seqs = [llm.requests.from_prompt(p, sp) for (p, _), sp in zip(reqs, params, strict=True)]
    for seq in seqs:
        llm.engine.add(seq)
    peak = 0
    while llm.engine.has_unfinished:
        llm.engine.step()
        peak = max(peak, llm.kv_usage()[0])
    wall = time.perf_counter() - t0
    done = [Completion.from_sequence(s) for s in seqs]
    tpot = [
        c.metrics.decode_s / (c.metrics.generated_tokens - 1)
        for c in done
        if c.metrics.generated_tokens > 1
    ]
    return {
        "tokens": [c.token_ids for c in done],
        "output_tokens": sum(len(c.token_ids) for c in done),
        "prompt_tokens": sum(c.metrics.prompt_tokens for c in done),
        "wall_s": wall,
        "tok_s": sum(len(c.token_ids) for c in done) / wall,
        "ttft_p50_ms": pct([c.metrics.ttft_s * 1e3 for c in done], 50),
        "ttft_p99_ms": pct([c.metrics.ttft_s * 1e3 for c in done], 99),
        "tpot_p50_ms": pct([t * 1e3 for t in tpot], 50),
        "tpot_p99_ms": pct([t * 1e3 for t in tpot], 99),
        "peak_kv_blocks": peak,
        "preemptions": llm.engine.stats().preemptions,
    }


def context(reqs) -> int:
    return max(len(p) + m for p, m in reqs) + 16


def edgeinfer_alone(path: str, threads: int, reqs) -> list[list[int]]:
    """Each request's tokens when it runs by itself, with nothing cached."""
    from edgeinfer import LLM, SamplingParams

    warm = LLM(path, threads=threads, ctx=context(reqs), parallel=1)
    warm.generate([reqs[0][0][:40]], SamplingParams(max_tokens=4, temperature=0))
    solo = LLM(
        path,
        threads=threads,
        ctx=context(reqs),
        parallel=1,
        prefix_caching=False,
        batch_invariant=True,
    )
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    return [solo.generate([p], g)[0].token_ids for (p, _), g in zip(reqs, greedy, strict=True)]


def edgeinfer_runs(path: str, threads: int, sizes: list[int], reqs, alone) -> dict:
    from edgeinfer import LLM

    ctx = context(reqs)
    rows = {}
    for n in sizes:
        llm = LLM(
            path,
            threads=threads,
            ctx=ctx,
            parallel=n,
            max_num_seqs=max(sizes),
            batch_invariant=True,
        )
        r = serve(llm, reqs[:n])
        r["identical"] = sum(a == b for a, b in zip(r.pop("tokens"), alone, strict=False))
        rows[n] = r
    return rows


def second_turn_ttft(path: str, threads: int) -> dict:
    """TTFT of a chat's second turn, with the first turn's blocks cached and without."""
    from edgeinfer import LLM, SamplingParams

    question = "Summarise this text in three sentences: " + PROSE * 3
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    out = {}
    for caching in (True, False):
        llm = LLM(path, threads=threads, ctx=2048, parallel=1, prefix_caching=caching)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
        history = [{"role": "user", "content": question}]
        reply = llm.chat(history, greedy)[0]
        history += [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "Now in one sentence."},
        ]
        second = llm.chat(history, SamplingParams(temperature=0, max_tokens=1))[0]
        key = "cached" if caching else "recomputed"
        out[key] = {
            "ttft_ms": second.metrics.ttft_s * 1e3,
            "prompt_tokens": second.metrics.prompt_tokens,
            "cached_tokens": second.metrics.cached_tokens,
        }
    out["ratio"] = out["cached"]["ttft_ms"] / out["recomputed"]["ttft_ms"]
    return out


def llama_cpp_serial(path: str, threads: int, reqs) -> list[dict]:
    """Each request through llama-cpp-python's create_completion, one after another."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=context(reqs),
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    no_eos = {llm.token_eos(): float("-inf")}
    llm.create_completion(reqs[0][0][:40], max_tokens=4, temperature=0)  # warm-up
    out = []
    for prompt, m in reqs:
        t0 = time.perf_counter()
        r = llm.create_completion(prompt, max_tokens=m, temperature=0, logit_bias=no_eos)
        out.append({"s": time.perf_counter() - t0, "tokens": r["usage"]["completion_tokens"]})
    return out


def _spawn_llama(path: str, threads: int, reqs) -> list[dict]:
    from edgeinfer.kernels import threads as knob

    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if knob.INHERITED_SPINCOUNT is None:  # llama.cpp with its own OpenMP defaults
        env.pop("GOMP_SPINCOUNT", None)
    cmd = [sys.executable, __file__, "--worker", path, "--threads", str(threads)]
    r = subprocess.run(cmd, input=json.dumps(reqs), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"llama-cpp-python worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def serial_tok_s(llama: list[dict], n: int) -> float:
    """Output tok/s of llama-cpp-python serving the first n requests one after another."""
    return sum(x["tokens"] for x in llama[:n]) / sum(x["s"] for x in llama[:n])


def best_rounds(edge_rounds: list[dict], llama_rounds: list[list[dict]]) -> tuple[dict, dict]:
    """-> per N, edgeinfer's fastest round (with every round's tok/s) and llama-cpp-python's
    best tok/s."""
    rows, llama = {}, {}
    for n in edge_rounds[0]:
        rows[n] = dict(max((r[n] for r in edge_rounds), key=lambda r: r["tok_s"]))
        rows[n]["rounds_tok_s"] = [r[n]["tok_s"] for r in edge_rounds]
        llama[n] = {
            "tok_s": max(serial_tok_s(rs, n) for rs in llama_rounds),
            "rounds_tok_s": [serial_tok_s(rs, n) for rs in llama_rounds],
        }
    return rows, llama


def markdown(model: str, threads: int, rows: dict, llama: dict, turn: dict) -> str:
    lines = [
        f"{model}, {threads} threads; llama-cpp-python serves the same requests one by one; "
        f"prompt tokens of the first N: "
        + ", ".join(f"{n}: {r['prompt_tokens']}" for n, r in rows.items()),
        "",
        "| N | out tok | edgeinfer tok/s | llama.cpp tok/s | ratio | TTFT p50/p99 ms "
        "| TPOT p50/p99 ms | peak KV blocks | preempted | identical to alone |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, r in rows.items():
        lt = llama[n]["tok_s"]
        lines.append(
            f"| {n} | {r['output_tokens']} | {r['tok_s']:.1f} | {lt:.1f} | "
            f"**{r['tok_s'] / lt:.2f}x** | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | {r['peak_kv_blocks']} | "
            f"{r['preemptions']} | {r['identical']}/{n} |"
        )
    lines += ["", "tok/s of every round (best shown above):"] + [
        f"- N = {n}: edgeinfer "
        + ", ".join(f"{v:.1f}" for v in r["rounds_tok_s"])
        + "; llama.cpp "
        + ", ".join(f"{v:.1f}" for v in llama[n]["rounds_tok_s"])
        for n, r in rows.items()
    ]
    c, f = turn["cached"], turn["recomputed"]
    lines += [
        "",
        f"second chat turn ({c['prompt_tokens']} prompt tokens): TTFT {c['ttft_ms']:.0f} ms "
        f"with prefix caching ({c['cached_tokens']} reused) vs {f['ttft_ms']:.0f} ms "
        f"recomputed: **{turn['ratio']:.0%}**",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument(
        "--max-output", type=int, default=256, help="outputs are 16 to this many tokens"
    )
    ap.add_argument("--rounds", type=int, default=2, help="turns each engine takes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.worker:
        reqs = json.loads(sys.stdin.read())
        print(json.dumps(llama_cpp_serial(args.model, args.threads, reqs)))
        return
    from edgeinfer import kernels
    from edgeinfer.gguf.hub import resolve_model
    from edgeinfer.tokenizer import Tokenizer

    path = str(resolve_model(args.model))
    threads = kernels.set_threads(args.threads)
    reqs = requests(Tokenizer.from_gguf(path), args.max_output)[: max(args.sizes)]
    alone = edgeinfer_alone(path, threads, reqs)
    edge_rounds, llama_rounds = [], []
    for i in range(args.rounds):
        turns = [
            lambda: llama_rounds.append(_spawn_llama(path, threads, reqs)),
            lambda: edge_rounds.append(
                edgeinfer_runs(path, threads, sorted(args.sizes), reqs, alone)
            ),
        ]
        for turn in turns if i % 2 == 0 else turns[::-1]:
            turn()
    rows, llama = best_rounds(edge_rounds, llama_rounds)
    turn = second_turn_ttft(path, threads)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "threads": threads,
                    "edgeinfer": rows,
                    "llama_cpp_serial": llama,
                    "llama_cpp_serial_rounds": llama_rounds,
                    "second_turn": turn,
                }
            )
        )
    else:
        print(markdown(args.model, threads, rows, llama, turn))


if __name__ == "__main__":
    main()
