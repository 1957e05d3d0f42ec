"""edgeinfer against llama.cpp at the sizes users run: 1B-3B models, contexts of 512 to 16k.

    python bench/scale.py [--models NAME ...] [--contexts 512 4096 16384] [--threads 2]
                          [--gen-tokens 32] [--rounds 1] [--kv-dtype f16 q8_0] [--quick] [--json]

Models come from bench/synth.py (real architectures' shapes, random weights, quantized by
llama.cpp), written on first use, or are real ones `edgeinfer pull` knows (REAL: gemma3-270m,
whose sliding-window layers keep only their window in both engines, up to 32k).
Per model and context C, each engine runs in its own subprocess (bench/compare.py's worker:
same file, same threads, the same C random token ids): prefill of the C-token prompt, then
`--gen-tokens` greedy tokens decoded at context C; also peak RSS and start-up (process start
to a first token, Numba's cache warm: compare.warm_kernels runs first, per model and KV type).
Decode is reported as a share of the bandwidth roofline: weight bytes plus the KV bytes at the
mean decode position, read once per token, over this run's measured bandwidth. `--kv-dtype`
runs each context with each KV cache type (both engines the same: llama.cpp's -ctk/-ctv, with
its flash attention for the quantized ones). The engines take turns, `--rounds` times each; the
best round of each figure is kept.
`--quick`: the 1B Q4_K_M model at context 512 only (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402
import synth  # noqa: E402

DEFAULT_CONTEXTS = (512, 4096, 16384)
REAL = ("gemma3-270m",)  # real models for --models (not in the default set)


def model_path(name: str) -> Path:
    if name in REAL:
        from edgeinfer.gguf.hub import resolve_model

        return resolve_model(name)
    return synth.model_path(name)


def measure(
    name: str, contexts, threads: int, gen: int, rounds: int, bandwidth: float, kv_dtypes=("f16",)
) -> list:
    path = model_path(name)
    from edgeinfer.gguf.model_config import ModelConfig
    from edgeinfer.gguf.reader import read_gguf

    with read_gguf(path) as g:
        vocab = ModelConfig.from_gguf(g).vocab_size
    rows = []
    for ctx, kv_dtype in [(c, k) for c in contexts for k in kv_dtypes]:
        ids = np.random.default_rng(ctx).integers(3, vocab, ctx).tolist()
        if ctx == contexts[0]:
            compare.warm_kernels(path, threads, ids, kv_dtype)
        weights, kv = compare.decode_bytes(path, ctx + gen // 2, kv_dtype)
        with compare.ids_on_disk(ids) as ids_path:
            runs = {engine: [] for engine in compare.ENGINES}
            for i in range(rounds):
                order = compare.ENGINES if i % 2 == 0 else compare.ENGINES[::-1]
                for engine in order:
                    runs[engine].append(
                        compare._spawn(engine, path, threads, ids_path, gen, kv_dtype)
                    )
        ours, theirs = (compare.best_of(runs[e]) for e in compare.ENGINES)
        roofline = bandwidth / (weights + kv)
        rows.append(
            {
                "model": name,
                "context": ctx,
                "kv_dtype": kv_dtype,
                "threads": threads,
                "decode_tok_s": ours["decode_tok_s"],
                "llama_decode_tok_s": theirs["decode_tok_s"],
                "decode_ratio": ours["decode_tok_s"] / theirs["decode_tok_s"],
                "prefill_tok_s": ours["prefill_tok_s"],
                "llama_prefill_tok_s": theirs["prefill_tok_s"],
                "prefill_ratio": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
                "roofline_tok_s": roofline,
                "roofline_pct": 100 * ours["decode_tok_s"] / roofline,
                "llama_roofline_pct": 100 * theirs["decode_tok_s"] / roofline,
                "peak_rss_mb": ours["peak_rss_mb"],
                "llama_peak_rss_mb": theirs["peak_rss_mb"],
                "start_s": ours["start_s"],
                "llama_start_s": theirs["start_s"],
                "weights_mb": weights / 1e6,
                "kv_mb": kv / 1e6,
            }
        )
        print(markdown(rows[-1:], bandwidth, header=len(rows) == 1), file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict], bandwidth: float, header: bool = True) -> str:
    lines = []
    if header:
        lines += [
            "| model | ctx | KV | decode tok/s (llama.cpp) | ratio | % roofline (llama.cpp) "
            "| prefill tok/s (llama.cpp) | ratio | peak RSS MB (llama.cpp) | start s (llama.cpp) |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['context']} | {r['kv_dtype']} "
            f"| {r['decode_tok_s']:.1f} ({r['llama_decode_tok_s']:.1f}) | {r['decode_ratio']:.2f}x "
            f"| {r['roofline_pct']:.0f} % ({r['llama_roofline_pct']:.0f} %) "
            f"| {r['prefill_tok_s']:.0f} ({r['llama_prefill_tok_s']:.0f}) "
            f"| {r['prefill_ratio']:.2f}x "
            f"| {r['peak_rss_mb']:.0f} ({r['llama_peak_rss_mb']:.0f}) "
            f"| {r['start_s']:.2f} ({r['llama_start_s']:.2f}) |"
        )
    if header and rows:
        lines.append(f"\nbandwidth {bandwidth / 1e9:.1f} GB/s ({rows[0]['threads']} threads)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    known = [*synth.MODELS, *REAL]
    ap.add_argument("--models", nargs="+", default=list(synth.MODELS), help=", ".join(known))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="turns each engine takes")
    ap.add_argument("--kv-dtype", nargs="+", default=["f16"], choices=list(compare.LLAMA_KV_TYPES),
                    help="KV cache types, each context with each")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="1B Q4_K_M at context 512 only")
    ap.add_argument("--json", action="store_true", help="print {'results': [...]} as JSON")
    args = ap.parse_args()
    if args.quick:
        args.models, args.contexts = ["llama-1b-q4_k_m"], [512]
    unknown = [m for m in args.models if m not in known]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.rounds < 1 or args.gen_tokens < 2 or min(args.contexts) < 16:
        ap.error("need --rounds >= 1, --gen-tokens >= 2 and every context >= 16")
    from bandwidth import read_bandwidth

    bandwidth = read_bandwidth(args.threads)
    rows = []
    for name in args.models:
        rows += measure(name, args.contexts, args.threads, args.gen_tokens, args.rounds, bandwidth,
                        args.kv_dtype)  # fmt: skip
    if args.json:
        print(json.dumps({"bandwidth_gb_s": bandwidth / 1e9, "results": rows}, indent=2))
    else:
        print(markdown(rows, bandwidth))


if __name__ == "__main__":
    main()
