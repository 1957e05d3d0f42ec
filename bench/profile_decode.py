"""Where a decode step's time goes: time inside kernels, by kind, against Python orchestration.

    python bench/profile_decode.py MODEL [--threads N] [--steps 64] [--prompt 128]

`profile_decode(runner)` is also what `bench/compare.py --profile` prints. Method: decode
`steps` tokens plainly (the step time), then again with every kernel entry point wrapped in a
timer; per kind it reports calls per step and milliseconds per step. Matmuls are timed twice:
per projection (qkv, o, gate_up, down, head — the `kernels.matmul` call, its Python wrapper
included) and inside the type's compiled kernel alone. "python" is the step time minus
compiled-kernel time: everything the interpreter does between kernels (the goal is <= 10 %),
given as two estimates (see `profile_decode`).
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

import edgeinfer.models.base as base
from edgeinfer import kernels
from edgeinfer.engine.engine import Engine
from edgeinfer.kernels.block_matmul import PartsKernel
from edgeinfer.llm import LLM

# Thin Python wrappers around one compiled kernel each (their own overhead is an np.empty).
_WRAPPED = {
    "rms_norm": "norm",
    "add_rms_norm": "norm",
    "self_attention": "attention",
    "gated_act": "activation",
    "softcap_": "activation",
}
COMPILED_MATMUL = "matmul kernel (compiled)"
# the module, not the `matmul` function the kernels package exports under the same name
kmatmul = importlib.import_module("edgeinfer.kernels.matmul")


class _Clock:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, kind: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - t0
                self.calls[kind] += 1

        return timed


@contextmanager
def _instrumented(runner, clock: _Clock):
    model = runner.model
    roles = {id(model.output): "head"}
    for L in model.layers:
        roles.update(
            {id(L.qkv): "qkv", id(L.wo): "o", id(L.gate_up): "gate_up", id(L.down): "down"}
        )
    saved_fns = {name: getattr(base, name) for name in _WRAPPED}
    saved_call = base.Linear.__call__
    saved_embedding = base.kernels.embedding
    all_linears = [model.output, *_linears(model)]
    units = {p.unit for lin in all_linears for p in lin.parts}
    kernel_fields = ("matmul_small", "matmul_rows")
    saved_units = {
        (u, f): getattr(u, f) for u in units for f in kernel_fields if getattr(u, f) is not None
    }
    # units' kernels that Linear binds at load
    saved_kernels = {fn: fn.kernel for fn in saved_units.values() if isinstance(fn, PartsKernel)}
    saved_tiled = kmatmul.matmul_tiled
    linears = [lin for lin in all_linears if lin.small is not None]
    saved_small = [lin.small for lin in linears]
    saved_row_wise = [lin.row_wise for lin in all_linears]

    def linear_call(self, x, row_wise=False):
        t0 = time.perf_counter()
        try:
            return saved_call(self, x, row_wise)
        finally:
            kind = f"matmul {roles.get(id(self), 'other')}"
            clock.seconds[kind] += time.perf_counter() - t0
            clock.calls[kind] += 1

    try:
        for name, kind in _WRAPPED.items():
            setattr(base, name, clock.wrap(kind, saved_fns[name]))
        base.Linear.__call__ = linear_call
        base.kernels.embedding = clock.wrap("embedding", saved_embedding)
        for (u, f), fn in saved_units.items():
            if isinstance(fn, PartsKernel):  # time the compiled kernel, not the Python around it
                fn.kernel = clock.wrap(COMPILED_MATMUL, fn.kernel)
            else:  # units are frozen dataclasses; this swap is undone below
                object.__setattr__(u, f, clock.wrap(COMPILED_MATMUL, fn))
        for lin in linears:  # decode calls go to kernels bound at load: bind the timed ones
            lin.small = kernels.bind_small(lin.parts)[0]
        for lin in all_linears:
            lin.row_wise = kernels.bind_row_wise(lin.parts)
        # types without a fused small-n kernel go through dequantize tiles + BLAS
        kmatmul.matmul_tiled = clock.wrap(COMPILED_MATMUL, saved_tiled)
        yield
    finally:
        for name, fn in saved_fns.items():
            setattr(base, name, fn)
        base.Linear.__call__ = saved_call
        base.kernels.embedding = saved_embedding
        for (u, f), fn in saved_units.items():
            object.__setattr__(u, f, fn)
        for fn, kernel in saved_kernels.items():
            fn.kernel = kernel
        for lin, small in zip(linears, saved_small, strict=True):
            lin.small = small
        for lin, row_wise in zip(all_linears, saved_row_wise, strict=True):
            lin.row_wise = row_wise
        kmatmul.matmul_tiled = saved_tiled


def _linears(model):
    for L in model.layers:
        yield from (L.qkv, L.wo, L.gate_up, L.down)


def _decode(engine: Engine, seq_id: int, first: int, steps: int) -> float:
    token = first
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(np.argmax(engine.forward(seq_id, [token])[-1]))
    return time.perf_counter() - t0


def _timer_overhead() -> float:
    clock = _Clock()
    noop = clock.wrap("x", lambda: None)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        noop()
    return (time.perf_counter() - t0) / n


def profile_decode(engine: Engine, steps: int = 64, prompt_len: int = 128, seed: int = 0):
    """Decode `steps` tokens after a random `prompt_len`-token prompt, plain and instrumented
    (the engine needs a context of prompt_len + 2 * steps + 4).

    -> dict: step_ms (plain), kinds {kind: {"calls": per step, "ms": per step}} (instrumented,
    timer overhead subtracted), kernel_ms (compiled kernels per step), python_ms, python_share;
    python_ms_plain, python_share_plain: the plain step minus kernel_ms.

    Two estimates of the same thing, which bracket it on a quiet machine: a timer costs more
    inside a step (its code and data cold after the weights streamed through the caches) than
    the warm cost subtracted, so python_ms keeps some timer cost; kernel_ms keeps the part of a
    timer's cost inside its own window, so python_ms_plain misses it. (On a noisy machine the
    plain and the instrumented runs can also land in different spells.)
    """
    rng = np.random.default_rng(seed)
    runner = engine.runner
    vocab = runner.config.vocab_size
    prompt = rng.integers(0, vocab, prompt_len).tolist()
    seq = 1 << 30  # an id no caller uses
    engine.release(seq)
    try:
        engine.forward(seq, prompt)
        _decode(engine, seq, prompt[-1], 4)  # warm-up (compilation, first-touch pages)
        plain = _decode(engine, seq, prompt[-1], steps) / steps
        clock = _Clock()
        with _instrumented(runner, clock):
            instrumented = _decode(engine, seq, prompt[-1], steps) / steps
    finally:
        engine.release(seq)
    overhead = _timer_overhead()
    kinds = {}
    for kind in sorted(clock.seconds):
        calls = clock.calls[kind] / steps
        ms = max(0.0, clock.seconds[kind] / steps - calls * overhead) * 1e3
        kinds[kind] = {"calls": calls, "ms": ms}
    compiled = [k for k in kinds if not k.startswith("matmul ") or k == COMPILED_MATMUL]
    kernel_ms = sum(kinds[k]["ms"] for k in compiled)
    # Scale the instrumented breakdown to the plain step (timers themselves cost a little).
    total_calls = sum(clock.calls.values()) / steps
    step_ms = plain * 1e3
    python_ms = max(0.0, instrumented * 1e3 - total_calls * overhead * 1e3 - kernel_ms)
    python_ms_plain = max(0.0, step_ms - kernel_ms)
    return {
        "model": runner.config.name,
        "threads": runner.threads,
        "context": prompt_len + steps,
        "step_ms": step_ms,
        "instrumented_step_ms": instrumented * 1e3,
        "kinds": kinds,
        "kernel_ms": kernel_ms,
        "python_ms": python_ms,
        # shares are of the instrumented step, the one the breakdown was measured in
        "python_share": python_ms / (instrumented * 1e3),
        "python_ms_plain": python_ms_plain,
        "python_share_plain": python_ms_plain / step_ms,
    }


def format_profile(p: dict) -> str:
    lines = [
        f"decode profile: {p['model']}, {p['threads']} threads, context {p['context']}: "
        f"{p['step_ms']:.2f} ms/step ({1e3 / p['step_ms']:.1f} tok/s); with timers "
        f"{p['instrumented_step_ms']:.2f} ms/step (shares below are of that)",
        "| kind | calls/step | ms/step | share |",
        "| --- | ---: | ---: | ---: |",
    ]
    step = p["instrumented_step_ms"]
    for kind, v in sorted(p["kinds"].items(), key=lambda kv: -kv[1]["ms"]):
        lines.append(f"| {kind} | {v['calls']:.0f} | {v['ms']:.3f} | {v['ms'] / step:.1%} |")
    lines.append(
        f"| compiled kernels (sum) | | {p['kernel_ms']:.3f} | {p['kernel_ms'] / step:.1%} |"
    )
    lines.append(f"| python between kernels | | {p['python_ms']:.3f} | {p['python_share']:.1%} |")
    lines.append(
        f"| python, plain step - kernels | | {p['python_ms_plain']:.3f} | "
        f"{p['python_share_plain']:.1%} of the plain step |"
    )
    lines.append(
        "(matmul <role> rows include the kernels.matmul wrapper; 'matmul kernel (compiled)' "
        "is the compiled part of all of them)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(args.model, threads=args.threads, ctx=args.prompt + 2 * args.steps + 8)
    print(format_profile(profile_decode(llm.engine, args.steps, args.prompt)))


if __name__ == "__main__":
    main()
