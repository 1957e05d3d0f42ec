"""Accuracy against exact math, perplexity and its speed against llama.cpp, and the per-type ladder.

    python bench/accuracy.py [kl] [ppl] [ladder] [--models M ...] [--threads 2] [--windows 8]
                             [--ctx 512] [--json]

kl      On the parity prompts (tests/data/parity_prompts.json, >= 256 positions), the mean
        KL(exact || engine) and top-1 agreement, exact = the float64 reference pass from the
        file's own dequantized weights (tests/reference_forward.py): edgeinfer's prompt path
        (--precision fast, the default: int8 activations, as llama.cpp's) with f16 and f32 KV,
        its exact path (--precision exact: float activations) with f16 KV, edgeinfer fed one
        token at a time (its decode kernels, int8 activations at small batches: the speed
        trade), llama.cpp batched with f16 and f32 KV, and llama.cpp one token at a time; then
        the quantized caches (--kv-dtype q8_0 / q4_0) beside llama.cpp's with the same cache
        types (-ctk/-ctv, which need its flash attention).
ppl     `edgeinfer eval`'s perplexity of the evaluation text (tests/data/eval/shakespeare.txt)
        over --windows windows of --ctx tokens beside llama.cpp's on the same windows (computed
        from its logits with the same rule), the seconds each took (logits and statistics), and
        the speed ratio.
ladder  SmolLM2's file (Q4_1 with Q8_0 tensors, the highest precision available without a
        model hub) dequantized to F32 by llama.cpp, quantized down every type by
        `edgeinfer quantize`'s wrapper, and each evaluated against the F32 file's saved
        log-probabilities: bits per weight, PPL, ln(PPL/PPL(F32)), mean KL, top-1.

Every section runs both engines in the same process, one after the other.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from llama_oracle import F32, PROMPTS, kl, log_softmax, oracle, oracle_logits  # noqa: E402
from reference_forward import ReferenceModel  # noqa: E402

TEXT = ROOT / "tests" / "data" / "eval" / "shakespeare.txt"
DEFAULT_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
QUANT_KV = {"q8_0": 8, "q4_0": 2}  # llama.cpp's type_k / type_v (GGML_TYPE_Q8_0, _Q4_0)
LADDER = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S",
          "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")  # fmt: skip


def _edgeinfer(path, threads: int, kv_dtype: str = "f16", precision: str = "fast"):
    from edgeinfer.llm import LLM

    return LLM(str(path), threads=threads, ctx=512, kv_dtype=kv_dtype, precision=precision)


def _one_token_at_a_time(llm, tokens) -> np.ndarray:
    seq = llm.requests.next_id()
    try:
        return np.concatenate([llm.engine.forward(seq, [t]) for t in tokens])
    finally:
        llm.engine.release(seq)


def measure_kl(model: str, threads: int) -> dict:
    from edgeinfer.gguf.hub import resolve_model

    path = resolve_model(model)
    ref = ReferenceModel(path)
    cpp = {
        "llama.cpp f16 KV": oracle(path, 512, threads),
        "llama.cpp f32 KV": oracle(path, 512, threads, type_k=F32, type_v=F32),
        "llama.cpp one token at a time": oracle(path, 512, threads, n_batch=1, n_ubatch=1),
        **{
            f"llama.cpp {name} KV": oracle(path, 512, threads, type_k=t, type_v=t, flash_attn=True)
            for name, t in QUANT_KV.items()
        },
    }
    ei16, ei32 = _edgeinfer(path, threads), _edgeinfer(path, threads, "f32")
    exact = _edgeinfer(path, threads, precision="exact")
    quant = {name: _edgeinfer(path, threads, name) for name in QUANT_KV}
    quant_exact = _edgeinfer(path, threads, "q8_0", precision="exact")
    engines = {
        "edgeinfer f16 KV": ei16.logits,
        "edgeinfer f32 KV": ei32.logits,
        "edgeinfer exact f16 KV": exact.logits,
        "edgeinfer one token at a time": lambda t: _one_token_at_a_time(ei16, t),
        **{f"edgeinfer {name} KV": llm.logits for name, llm in quant.items()},
        "edgeinfer exact q8_0 KV": quant_exact.logits,
        **{k: (lambda t, o=o: oracle_logits(o, t)) for k, o in cpp.items()},
    }
    kls = {k: [] for k in engines}
    top = {k: [] for k in engines}
    for text in PROMPTS:
        tokens = cpp["llama.cpp f16 KV"].tokenize(text.encode(), add_bos=True, special=False)
        exact = ref.logits(tokens)
        for name, run in engines.items():
            logits = np.asarray(run(tokens), dtype=np.float64)
            kls[name].append(kl(exact, logits))
            top[name].append(exact.argmax(-1) == logits.argmax(-1))
    rows = [
        {"engine": k, "kl": float(np.concatenate(kls[k]).mean()),
         "top1": float(np.concatenate(top[k]).mean())}
        for k in engines
    ]  # fmt: skip
    return {"model": model, "positions": int(sum(len(x) for x in kls["edgeinfer f16 KV"])),
            "rows": rows}  # fmt: skip


def measure_ppl(model: str, threads: int, n_ctx: int, n_windows: int) -> dict:
    from edgeinfer.eval import windows
    from edgeinfer.gguf.hub import resolve_model
    from edgeinfer.llm import LLM

    path = resolve_model(model)
    llm = LLM(str(path), threads=threads, ctx=n_ctx, parallel=1)
    tokens = np.array(llm.tokenizer.encode(TEXT.read_text()), np.int64)
    windows.evaluate(llm, tokens[:n_ctx], n_ctx)  # warm-up: kernels compiled, pages mapped
    t = time.perf_counter()
    ours = windows.evaluate(llm, tokens, n_ctx, n_windows).summary
    ours_s = time.perf_counter() - t

    o = oracle(path, n_ctx, threads)
    adds_bos = o.tokenize(b"a", add_bos=True)[0] == o.token_bos()
    o.reset()
    o.eval(tokens[:n_ctx].tolist())  # warm-up
    first, nll = n_ctx // 2, []
    t = time.perf_counter()
    for i in range(n_windows):
        w = tokens[i * n_ctx : (i + 1) * n_ctx].tolist()
        if adds_bos:
            w[0] = o.token_bos()
        o.reset()
        o.eval(w)
        lp = log_softmax(np.array(o.scores[first : n_ctx - 1]))
        nll.append(-lp[np.arange(n_ctx - 1 - first), w[first + 1 :]])
    theirs_s = time.perf_counter() - t
    theirs = math.exp(np.concatenate(nll).mean())
    return {
        "model": model, "ctx": n_ctx, "windows": n_windows, "tokens": ours["tokens"],
        "edgeinfer_ppl": ours["perplexity"], "edgeinfer_ppl_stderr": ours["perplexity_stderr"],
        "llama_cpp_ppl": theirs, "ppl_rel_diff": ours["perplexity"] / theirs - 1,
        "edgeinfer_s": ours_s, "llama_cpp_s": theirs_s, "speed_ratio": theirs_s / ours_s,
        "edgeinfer_tok_s": n_windows * n_ctx / ours_s,
        "llama_cpp_tok_s": n_windows * n_ctx / theirs_s,
    }  # fmt: skip


def _dequantize_to_f32(src: Path, dst: Path, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.nthread = threads
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)):
        raise RuntimeError(f"could not dequantize {src}")


def measure_ladder(threads: int, n_ctx: int, n_windows: int) -> dict:
    from edgeinfer.eval import windows
    from edgeinfer.eval.logits_file import LogitsReader
    from edgeinfer.eval.quantize import quantize
    from edgeinfer.eval.weights import bits_per_weight
    from edgeinfer.gguf.hub import resolve_model
    from edgeinfer.gguf.reader import read_gguf
    from edgeinfer.llm import LLM

    src = resolve_model("smollm2-135m-instruct")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "smollm2-F32.gguf"
        _dequantize_to_f32(src, f32, threads)
        base = LLM(str(f32), threads=threads, ctx=n_ctx, parallel=1)
        tokens = np.array(base.tokenizer.encode(TEXT.read_text()), np.int64)
        saved = Path(tmp) / "f32.logits"
        r = windows.evaluate(base, tokens, n_ctx, n_windows, save_logits=str(saved)).summary
        rows.append({"type": "F32", "bpw": 32.0, "ppl": r["perplexity"], "kl": 0.0, "top1": 1.0,
                     "ln_ratio": 0.0})  # fmt: skip
        del base
        reader = LogitsReader(saved)
        for t in LADDER:
            out = Path(tmp) / f"{t}.gguf"
            quantize(f32, out, t, threads)
            llm = LLM(str(out), threads=threads, ctx=n_ctx, parallel=1)
            r = windows.evaluate(llm, tokens, n_ctx, n_windows, reference=reader).summary
            rows.append({
                "type": t, "bpw": bits_per_weight(read_gguf(out)), "ppl": r["perplexity"],
                "kl": r["kl"]["mean"], "top1": r["top1_agreement"], "ln_ratio": r["ln_ppl_ratio"],
            })  # fmt: skip
            print(f"  {t}: PPL {r['perplexity']:.4f}, KL {r['kl']['mean']:.4f}", file=sys.stderr)
            del llm
            out.unlink()
    return {"source": f"{src.name} dequantized to F32", "ctx": n_ctx, "windows": n_windows,
            "rows": rows}  # fmt: skip


def markdown(results: dict) -> str:
    out = []
    for r in results.get("kl", []):
        out += [f"**{r['model']}**: KL(exact || engine), {r['positions']} positions", "",
                "| engine | mean KL | top-1 |", "| --- | ---: | ---: |"]  # fmt: skip
        out += [f"| {x['engine']} | {x['kl']:.2e} | {x['top1']:.2%} |" for x in r["rows"]]
        out.append("")
    if results.get("ppl"):
        out += ["| model | windows x ctx | edgeinfer PPL | llama.cpp PPL | diff | edgeinfer "
                "tok/s | llama.cpp tok/s | speed ratio |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for r in results["ppl"]:
            out.append(
                f"| {r['model']} | {r['windows']} x {r['ctx']} | {r['edgeinfer_ppl']:.4f} ± "
                f"{r['edgeinfer_ppl_stderr']:.4f} | {r['llama_cpp_ppl']:.4f} | "
                f"{r['ppl_rel_diff']:+.2%} | {r['edgeinfer_tok_s']:.0f} | "
                f"{r['llama_cpp_tok_s']:.0f} | {r['speed_ratio']:.2f}x |"
            )
        out.append("")
    if results.get("ladder"):
        r = results["ladder"]
        out += [f"Ladder: {r['source']}, {r['windows']} windows x {r['ctx']}", "",
                "| type | bits/weight | PPL | ln(PPL/PPL(F32)) | mean KL | top-1 |",
                "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        out += [f"| {x['type']} | {x['bpw']:.2f} | {x['ppl']:.4f} | {x['ln_ratio']:+.4f} | "
                f"{x['kl']:.4f} | {x['top1']:.2%} |" for x in r["rows"]]  # fmt: skip
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sections", nargs="*", default=["kl", "ppl"],
                    help="kl, ppl, ladder (default: kl ppl)")  # fmt: skip
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict = {}
    if "kl" in args.sections:
        results["kl"] = [measure_kl(m, args.threads) for m in args.models]
    if "ppl" in args.sections:
        results["ppl"] = [measure_ppl(m, args.threads, args.ctx, args.windows) for m in args.models]
    if "ladder" in args.sections:
        results["ladder"] = measure_ladder(args.threads, args.ctx, args.windows)
    print(json.dumps(results, indent=2) if args.json else markdown(results))


if __name__ == "__main__":
    main()
