"""How far edgeinfer's logits are from llama.cpp's, next to how far llama.cpp is from itself.

    python bench/parity.py [--models M ...] [--threads 2]

Same GGUF file, same token ids (llama.cpp's tokenizer), logits at every position of the
parity prompts (tests/data/parity_prompts.json, the ones test_models_parity uses). Five
configurations: edgeinfer and llama.cpp (llama-cpp-python, batched, as the test's oracle),
each with a float16 and a float32 KV cache, and llama.cpp fed one token at a time. For pairs
of them: mean KL(first || second), over every position and over the first 16 and the rest,
and top-1 agreement.

What to read in it. KV precision moves edgeinfer's own logits very little, while llama.cpp
rounds activations to int8 blocks before every quantized matmul (Q8_0 / Q8_1 / Q8_K), so a
difference far below that rounding upstream (f16 against f32 K/V, another summation order)
flips some roundings and comes out at the size of the rounding itself. That spread of
llama.cpp against itself is the floor any implementation that is not bit-identical to its
kernels meets.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from llama_oracle import F32, PROMPTS, kl, oracle, oracle_logits  # noqa: E402

DEFAULT_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
N_CTX = 512
EARLY = 16  # positions counted as the start of a prompt
PAIRS = (
    ("llama.cpp f16", "edgeinfer f16"),
    ("llama.cpp f32", "edgeinfer f32"),
    ("llama.cpp f16", "llama.cpp f32"),
    ("llama.cpp f16", "llama.cpp one token"),
    ("edgeinfer f16", "edgeinfer f32"),
)


def _edgeinfer(path: Path, threads: int, kv_dtype: str):
    from edgeinfer.llm import LLM

    llm = LLM(str(path), threads=threads, ctx=N_CTX, kv_dtype=kv_dtype)

    def logits(tokens: list[int]) -> np.ndarray:
        return llm.logits(tokens).astype(np.float64)

    return logits


def measure(model: str, threads: int) -> dict:
    from edgeinfer.gguf.hub import resolve_model

    path = resolve_model(model)
    contexts = {
        "llama.cpp f16": oracle(path, N_CTX, threads),
        "llama.cpp f32": oracle(path, N_CTX, threads, type_k=F32, type_v=F32),
        "llama.cpp one token": oracle(path, N_CTX, threads, n_batch=1, n_ubatch=1),
    }
    engines = {
        **{name: partial(oracle_logits, llm) for name, llm in contexts.items()},
        "edgeinfer f16": _edgeinfer(path, threads, "f16"),
        "edgeinfer f32": _edgeinfer(path, threads, "f32"),
    }
    kls = {pair: [] for pair in PAIRS}
    agree = {pair: [] for pair in PAIRS}
    positions = []
    for text in PROMPTS:
        tokens = contexts["llama.cpp f16"].tokenize(text.encode(), add_bos=True, special=False)
        logits = {name: run(tokens) for name, run in engines.items()}
        positions.append(np.arange(len(tokens)))
        for a, b in PAIRS:
            kls[a, b].append(kl(logits[a], logits[b]))
            agree[a, b].append(logits[a].argmax(-1) == logits[b].argmax(-1))
    pos = np.concatenate(positions)
    rows = []
    for pair in PAIRS:
        k = np.concatenate(kls[pair])
        rows.append(
            {
                "first": pair[0],
                "second": pair[1],
                "kl": float(k.mean()),
                "kl_early": float(k[pos < EARLY].mean()),
                "kl_late": float(k[pos >= EARLY].mean()),
                "top1": float(np.concatenate(agree[pair]).mean()),
            }
        )
    return {"model": model, "threads": threads, "positions": int(pos.size), "pairs": rows}


def markdown(result: dict) -> str:
    lines = [
        f"**{result['model']}** ({result['positions']} positions, {result['threads']} threads)",
        "",
        f"| first | second | mean KL | KL at positions < {EARLY} | KL after | top-1 |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["pairs"]:
        lines.append(
            f"| {r['first']} | {r['second']} | {r['kl']:.2e} | {r['kl_early']:.2e} | "
            f"{r['kl_late']:.2e} | {r['top1']:.2%} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    results = [measure(m, args.threads) for m in args.models]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print("\n\n".join(markdown(r) for r in results))


if __name__ == "__main__":
    main()
