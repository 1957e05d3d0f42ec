"""Layers offloaded to a ggml backend: prefill and decode tok/s with 0, half and all layers
offloaded, against llama.cpp (llama-cpp-python) with the same n_gpu_layers, same file, same run.

    python bench/offload.py [--model M] [--backend cpu|cuda] [--threads 2] [--prompt 256]
                            [--tokens 64] [--repeats 3] [--json] [--save FILE]

Splits: 0 layers; the last half (the head stays on the host, as llama.cpp's -ngl n/2); all
layers and the head (llama.cpp's -ngl 99). On `cuda` llama.cpp loads the same backend module
(`make cuda`), so both sides use the same kernels for the offloaded layers. On `cpu` (ggml's CPU
backend, where no GPU is) llama.cpp runs everything on its CPU kernels whatever the split, and
the figures that matter are edgeinfer's executor against edgeinfer's own kernels and the
executor's overhead per layer and decode step: the time a step spends in the span executor
beyond ggml's graph compute (inputs, masks, Python), divided by the span's layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import psutil

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.gguf.hub import resolve_model
from edgeinfer.llm import LLM


class _TimedLib:
    """Forwards to the ggml bindings, adding up the time spent in graph computes."""

    def __init__(self, lib):
        self._lib = lib
        self.compute_s = 0.0
        self.calls = 0

    def ggml_backend_graph_compute(self, backend, graph):
        t = time.perf_counter()
        status = self._lib.ggml_backend_graph_compute(backend, graph)
        self.compute_s += time.perf_counter() - t
        self.calls += 1
        return status

    def __getattr__(self, name):
        return getattr(self._lib, name)


def _timed_executor(llm: LLM):
    """Wrap the span executor's call and its ggml library to split a step's time."""
    ex = llm._runner.executor
    if ex is None:
        return None
    ex.backend_lib = timed = _TimedLib(ex.backend_lib)
    timed.total_s = 0.0
    call = ex.__call__.__func__

    class Timed(type(ex)):
        def __call__(self, x, batch):
            t = time.perf_counter()
            out = call(self, x, batch)
            timed.total_s += time.perf_counter() - t
            return out

    ex.__class__ = Timed
    return timed


def spec_for(split: str, n_layers: int, backend: str) -> dict:
    if split == "none":
        return {}
    if backend.startswith("cuda"):
        return {"gpu_layers": n_layers // 2 if split == "half" else n_layers}
    if split == "half":
        return {"offload": f"{n_layers - n_layers // 2}-{n_layers - 1}@{backend}"}
    return {"offload": f"all@{backend}"}


def ngl_for(split: str, n_layers: int) -> int:
    return {"none": 0, "half": n_layers // 2, "all": 99}[split]


def bench_edgeinfer(path, knobs, threads, prompt, tokens, repeats) -> dict:
    llm = LLM(str(path), threads=threads, ctx=len(prompt) + tokens + 16, prefix_caching=False,
              **knobs)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompt[:32], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    timed = _timed_executor(llm)
    pre, dec, over = [], [], []
    for _ in range(repeats):
        if timed:
            timed.total_s = timed.compute_s = 0.0
            timed.calls = 0
        m = llm.generate(prompt, params)[0].metrics
        pre.append(m.prefill_tok_s)
        dec.append(m.decode_tok_s)
        if timed:
            # decode steps dominate the calls; the prompt's one call is counted too
            n = len(llm._runner.executor.layers)
            over.append((timed.total_s - timed.compute_s) / timed.calls / n * 1e6)
    out = {
        "prefill_tok_s": statistics.median(pre),
        "decode_tok_s": statistics.median(dec),
        "placement": llm.placement(),
    }
    if over:
        out["overhead_us_per_layer_step"] = statistics.median(over)
    return out


def bench_llama(path, ngl, threads, prompt, tokens, repeats) -> dict:
    import llama_cpp

    n_ctx = len(prompt) + tokens + 16
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_gpu_layers=ngl, verbose=False
    )
    return time_llama(llm, prompt, tokens, repeats)


def time_llama(llm, prompt, tokens, repeats) -> dict:
    """Median prefill and decode tok/s of a llama_cpp.Llama over `repeats` runs. An async
    backend (CUDA, RPC) may still be computing the prompt when llama_decode returns, so the
    first decode step is timed with the prompt (and one decode step's time taken off it)."""
    pre, dec = [], []
    for _ in range(repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        prompt_s = time.perf_counter() - t
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(tokens - 2):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        step_s = (time.perf_counter() - t) / (tokens - 2)
        dec.append(1 / step_s)
        pre.append(len(prompt) / (prompt_s - step_s))
    return {"prefill_tok_s": statistics.median(pre), "decode_tok_s": statistics.median(dec)}


def load_cuda_module_for_llama() -> None:
    """llama.cpp picks up the CUDA backend edgeinfer loads: same registry, same module."""
    from edgeinfer.ggml.backends import open_backend

    open_backend("cuda").close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--save", help="also write the JSON object to this file")
    args = ap.parse_args()
    path = resolve_model(args.model)
    if args.backend.startswith("cuda"):
        load_cuda_module_for_llama()
    probe = LLM(str(path), ctx=64)
    n_layers, vocab = probe.config.n_layers, probe.config.vocab_size
    del probe
    prompt = np.random.default_rng(0).integers(100, vocab - 100, args.prompt).tolist()
    load = os.getloadavg()[0]
    rows = []
    for split in ("none", "half", "all"):
        knobs = spec_for(split, n_layers, args.backend)
        ours = bench_edgeinfer(path, knobs, args.threads, prompt, args.tokens, args.repeats)
        ngl = ngl_for(split, n_layers)
        ref = bench_llama(path, ngl, args.threads, prompt, args.tokens, args.repeats)
        rows.append({"split": split, "knobs": knobs, "n_gpu_layers": ngl, "edgeinfer": ours,
                     "llama.cpp": ref})  # fmt: skip
    result = {
        "model": str(path),
        "backend": args.backend,
        "threads": args.threads,
        "prompt_tokens": args.prompt,
        "generated_tokens": args.tokens,
        "load_avg_1m_at_start": load,
        "cpus": psutil.cpu_count(),
        "rows": rows,
    }
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{path.name}, backend {args.backend}, {args.threads} threads, prompt {args.prompt}, "
        f"{args.tokens} generated; load average {load:.1f} on {psutil.cpu_count()} CPUs"
    )
    base = rows[0]["edgeinfer"]
    print(f"{'split':<6}{'ngl':>4} | {'edgeinfer pp':>12}{'tg':>8} | {'llama.cpp pp':>12}{'tg':>8} "
          f"| {'tg ratio':>8} {'tg vs 0':>8} | overhead/layer/step")  # fmt: skip
    for r in rows:
        e, l = r["edgeinfer"], r["llama.cpp"]
        over = e.get("overhead_us_per_layer_step")
        print(
            f"{r['split']:<6}{r['n_gpu_layers']:>4} | {e['prefill_tok_s']:>12.1f}"
            f"{e['decode_tok_s']:>8.1f} | {l['prefill_tok_s']:>12.1f}{l['decode_tok_s']:>8.1f} | "
            f"{e['decode_tok_s'] / l['decode_tok_s']:>8.2f} "
            f"{e['decode_tok_s'] / base['decode_tok_s']:>8.2f} | "
            + ("-" if over is None else f"{over:.0f} us")
        )
    for r in rows[1:]:
        print(f"  {r['split']}: {r['edgeinfer']['placement']}")


if __name__ == "__main__":
    main()
