"""Speculative decoding: decode tok/s with and without drafts, beside llama.cpp's prompt lookup.

    python bench/speculative.py [MODEL] [--threads N] [--max-tokens N] [--streams 16] [--json]

Workloads, each a chat request at temperature 0 (so every configuration writes the same text,
checked below):
- code: rewrite a source file of this repository with one small change (copies most of it);
- quote: summarise a passage, quoting its key sentences;
- chat: a free question (little to copy: speculation must cost nothing here);
- streams: `--streams` concurrent copy-heavy requests (code edits of different files): their
  aggregate decode tok/s (the sum of each reply's rate after its first token), and all of their
  output over the wall time of the whole batch, their prompts' time included.
For each: edgeinfer without speculation, with `--spec ngram`, and llama-cpp-python on the same
GGUF and prompt with and without `LlamaPromptLookupDecoding` (its prompt lookup), same threads,
in this process, one after the other. The draft-model proposer runs on a synthetic pair (the
tests' tiny llama F32 target with its own Q8_0 copy as draft: no real draft/target pair with
one vocabulary is cached here). Figures from a shared machine are noisy: compare the ratios,
each measured in one run; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.gguf import hub
from edgeinfer.llm import LLM

ROOT = Path(__file__).resolve().parent.parent
CODE = ["edgeinfer/engine/stop.py", "edgeinfer/speculative/ngram.py", "edgeinfer/errors.py"]
PASSAGE = (
    "The lighthouse keeper climbed the one hundred and twelve steps every evening at dusk. "
    "He trimmed the wick, polished the great lens until it shone, and wound the clockwork that "
    "turned the light. Ships passing the reef at night saw the beam sweep across the water "
    "every ten seconds, and they knew to keep two miles offshore. In forty years the light "
    "never once failed, not in the storm of 1911 nor in the long winter when ice sealed the "
    "harbour for three months. When the keeper retired, the light was automated, and the "
    "tower stood empty, though sailors still spoke of the old man who never let it go dark."
)


def code_prompt(path: str) -> list[dict]:
    text = (ROOT / path).read_text()
    ask = "Rewrite this Python file exactly, but rename every variable called `text` to `s`."
    # the file first, then the ask: with the ask first, SmolLM2 135M writes a new function
    # rather than the file (1.4 tokens a step of prompt lookup against 3.9)
    return [{"role": "user", "content": f"```python\n{text}```\n\n{ask}"}]


WORKLOADS = {
    "code": code_prompt(CODE[0]),
    "quote": [
        {
            "role": "user",
            "content": f"Summarise this passage, quoting its most important sentences word "
            f"for word:\n\n{PASSAGE}",
        }
    ],
    "chat": [{"role": "user", "content": "What are three good habits for learning a language?"}],
}


def edgeinfer_run(llm: LLM, convs: list[list[dict]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = llm.stats()
    t0 = time.perf_counter()
    out = llm.chat(convs, params)
    wall = time.perf_counter() - t0
    s = llm.stats()
    tokens = sum(len(c.token_ids) for c in out)
    proposed = s.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = s.spec_accepted_tokens - before.spec_accepted_tokens
    return {
        # each reply's tokens after its first over their time (None: one token); for many,
        # the sum: their aggregate rate while they decode side by side, prompts not counted
        "decode_tok_s": out[0].metrics.decode_tok_s
        if len(out) == 1
        else sum(c.metrics.decode_tok_s or 0.0 for c in out),
        # all of the output over the whole wall time, prompts included
        "output_tok_s": tokens / wall,
        "tokens": tokens,
        "acceptance": accepted / proposed if proposed else None,
        "token_ids": [c.token_ids for c in out],
    }


def llama_run(llama, conv: list[dict], max_tokens: int) -> dict:
    """Decode tok/s of one streamed chat completion: tokens after the first over their time."""
    stamps = []
    for chunk in llama.create_chat_completion(
        conv, max_tokens=max_tokens, temperature=0.0, stream=True
    ):
        if chunk["choices"][0]["delta"].get("content"):
            stamps.append(time.perf_counter())
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    # a streamed chunk is one token's text (an empty piece is not counted: a lower bound)
    return {"decode_tok_s": (len(stamps) - 1) / span if span else None, "tokens": len(stamps)}


def _rate(tok_s: float | None) -> str:
    # None: a reply of one token or none (llama.cpp's chat template may end it at once)
    return "n/a" if tok_s is None else f"{tok_s:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=hub.DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--spec-k", type=int, default=6)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    path = hub.resolve_model(args.model)
    rows, report = [], {"model": args.model, "threads": args.threads}

    def show(*cols):
        rows.append(cols)
        if not args.json:
            print(
                "  ".join(f"{c:>12}" if i else f"{c:<22}" for i, c in enumerate(cols)), flush=True
            )

    load = os.getloadavg()[0]
    show(
        "workload",
        "plain tok/s",
        "ngram tok/s",
        "ngram x",
        "accepted",
        "llama tok/s",
        "lookup tok/s",
        "lookup x",
        "ngram/lookup",
    )
    ctx = 2048
    plain = LLM(str(path), threads=args.threads, ctx=ctx, parallel=1, prefix_caching=False)
    spec = LLM(
        str(path),
        threads=args.threads,
        ctx=ctx,
        parallel=1,
        prefix_caching=False,
        speculative="ngram",
        spec_k=args.spec_k,
    )
    for llm in (plain, spec):  # compile (or load from the cache) every kernel first
        llm.chat(WORKLOADS["chat"], SamplingParams(temperature=0, max_tokens=8))
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def llama(draft):
        # a draft model needs every position's logits kept (its scores buffer is n_batch rows
        # otherwise, and verifying past them fails)
        return llama_cpp.Llama(
            str(path),
            n_ctx=ctx,
            n_threads=args.threads,
            verbose=False,
            draft_model=draft,
            logits_all=draft is not None,
        )

    ll_plain, ll_lookup = llama(None), llama(LlamaPromptLookupDecoding(num_pred_tokens=10))
    for name, conv in WORKLOADS.items():
        a = edgeinfer_run(plain, [conv], args.max_tokens)
        b = edgeinfer_run(spec, [conv], args.max_tokens)
        c = llama_run(ll_plain, conv, args.max_tokens)
        d = llama_run(ll_lookup, conv, args.max_tokens)
        same = a["token_ids"] == b["token_ids"]
        report[name] = {"plain": a, "ngram": b, "llama": c, "llama_lookup": d, "same": same}
        for r in (a, b):
            del r["token_ids"]
        rates = [r["decode_tok_s"] for r in (a, b, c, d)]
        show(
            name + ("" if same else " (differs)"),
            *(_rate(r) for r in rates[:2]),
            _ratio(rates[1], rates[0]),
            f"{b['acceptance'] or 0:.0%}",
            *(_rate(r) for r in rates[2:]),
            _ratio(rates[3], rates[2]),
            _ratio(rates[1], rates[3]),
        )
    del ll_plain, ll_lookup

    # concurrent copy-heavy streams: aggregate output tok/s over the batch's wall time
    convs = [code_prompt(CODE[i % len(CODE)]) for i in range(args.streams)]
    # a synthetic model's vocabulary cuts the files into more tokens than a real one's
    longest = max(len(plain.requests.chat_token_ids(conv)) for conv in convs)
    stream_tokens = args.max_tokens // 2
    stream_ctx = max(ctx, longest + stream_tokens)
    many = {}
    for label, knobs in (("plain", {}), ("ngram", {"speculative": "ngram", "spec_k": args.spec_k})):
        llm = LLM(
            str(path),
            threads=args.threads,
            ctx=stream_ctx,
            parallel=args.streams,
            prefix_caching=False,
            **knobs,
        )
        llm.chat(WORKLOADS["chat"], SamplingParams(temperature=0, max_tokens=4))
        many[label] = edgeinfer_run(llm, convs, stream_tokens)
        del many[label]["token_ids"]
        del llm
    report["streams"] = many
    for rate, label in (("decode_tok_s", "decode"), ("output_tok_s", "output/wall")):
        plain_rate, ngram_rate = many["plain"][rate], many["ngram"][rate]
        show(
            f"{args.streams} streams, {label}",
            f"{plain_rate:.1f}",
            f"{ngram_rate:.1f}",
            f"{ngram_rate / plain_rate:.2f}",
            f"{many['ngram']['acceptance'] or 0:.0%}",
        )

    draft_pair(args, show, report)
    load = (load + os.getloadavg()[0]) / 2
    report["load_avg"] = load
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"load average {load:.1f} on {os.cpu_count()} cores (shared machine: ratios, "
            "each from one run, are what to compare)",
            file=sys.stderr,
        )


def draft_pair(args, show, report) -> None:
    """The draft-model proposer on the synthetic pair (tests/synthetic.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import numpy as np
    import synthetic

    target, draft = synthetic.model_path("llama", "F32"), synthetic.model_path("llama", "Q8_0")
    prompts = [np.random.default_rng(i).integers(0, 500, 40).tolist() for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    got = {}
    for label, knobs in (("plain", {}), ("draft", {"speculative": f"draft:{draft}"})):
        llm = LLM(
            str(target), threads=args.threads, ctx=256, parallel=1, spec_k=args.spec_k, **knobs
        )
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))
        tok_s = []
        for p in prompts:
            tok_s.append(llm.generate(p, params)[0].metrics.decode_tok_s)
        s = llm.stats()
        got[label] = {"decode_tok_s": sum(tok_s) / len(tok_s), "acceptance": s.spec_acceptance_rate}
    report["draft_synthetic"] = got
    x = got["draft"]["decode_tok_s"] / got["plain"]["decode_tok_s"]
    show(
        "draft (synthetic)",
        f"{got['plain']['decode_tok_s']:.1f}",
        f"{got['draft']['decode_tok_s']:.1f}",
        f"{x:.2f}",
        f"{got['draft']['acceptance']:.0%}",
    )


if __name__ == "__main__":
    main()
