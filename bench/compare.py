"""edgeinfer against llama.cpp (llama-cpp-python) on the same GGUF file and thread count.

    python bench/compare.py [--models M ...] [--threads 1 2] [--prompt-tokens 512]
                            [--gen-tokens 128] [--rounds 3] [--json] [--profile]

Per model and thread count, each engine runs in its own subprocess (so peak RSS is its own):
load, warm up (JIT compilation, first-touch pages), then one greedy request of a
`--prompt-tokens` prompt (the same token ids for both) and `--gen-tokens` generated tokens
(EOS ignored). The engines take turns, `--rounds` times each (A B, B A, ...): on a shared
machine a slow spell of tens of seconds otherwise lands on one engine only. Reported, per
engine, the best round of each figure: prefill tok/s, TTFT, decode tok/s (tokens after the
first / the time after the first), peak RSS (the highest), start-up (process start to the first
token of a 16-token prompt, kernels already compiled: an unmeasured run fills Numba's disk
cache first), and decode as a share of the bandwidth roofline: bytes read per decode step
(every weight byte the step touches, plus the f16 KV cache at the mean decode position) /
memory bandwidth measured in this run with the same thread count. Every round's decode tok/s
is listed under the table.
`--profile` adds bench/profile_decode.py's per-step decode profile for each case.
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
from contextlib import contextmanager
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ENGINES = ("edgeinfer", "llama.cpp")
DEFAULT_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
# KV cache types both engines can run -> llama.cpp's type_k / type_v (GGML type ids)
LLAMA_KV_TYPES = {"f16": 1, "f32": 0, "q8_0": 8, "q4_0": 2}
# any prose works: the prompt is cut to an exact token count
_PROMPT_TEXT = (
    "The history of computing is a story of machines that grew smaller, faster and cheaper. "
    "Early computers filled rooms and consumed enormous amounts of power, yet they performed "
    "fewer operations per second than a modern wristwatch. Over the decades, engineers learned "
    "to pack more transistors onto silicon, and programmers learned to make them do more work. "
)


def prompt_ids(path: Path, n: int) -> list[int]:
    """n token ids of plain prose, from llama.cpp's tokenizer (vocab only, no weights)."""
    import llama_cpp

    tok = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ids = tok.tokenize(_PROMPT_TEXT.encode(), add_bos=True)
    body = tok.tokenize(_PROMPT_TEXT.encode(), add_bos=False)
    while len(ids) < n:
        ids += body
    return ids[:n]


def decode_bytes(path: Path, mean_pos: int, kv_dtype: str = "f16") -> tuple[int, int]:
    """(weight bytes, KV bytes of a kv_dtype cache) one decode step reads at context position
    mean_pos."""
    from edgeinfer.engine.memory_plan import kv_layer_bytes_per_token
    from edgeinfer.gguf.model_config import ModelConfig
    from edgeinfer.gguf.reader import read_gguf

    g = read_gguf(path)
    try:
        cfg = ModelConfig.from_gguf(g)
        emb = g.tensors["token_embd.weight"]
        weights = sum(t.nbytes for t in g.tensors.values())
        if not cfg.tied_output:  # the embedding is only looked up: one row per step
            weights -= emb.nbytes - emb.nbytes // emb.shape[0]
    finally:
        g.close()
    per_pos = kv_layer_bytes_per_token(cfg, kv_dtype)
    kv = 0
    for layer in range(cfg.n_layers):
        span = mean_pos
        if cfg.sliding_window and cfg.is_sliding(layer):
            span = min(span, cfg.sliding_window)
        kv += span * per_pos
    return weights, kv


def _worker(
    engine: str, path: str, threads: int, ids_file: str, gen: int, t_spawn: float, kv: str
) -> dict:
    ids = json.loads(Path(ids_file).read_text())
    run = _run_edgeinfer if engine == "edgeinfer" else _run_llama_cpp
    out = run(path, threads, ids, gen, t_spawn, kv)
    out["peak_rss_mb"] = _peak_rss() / 1e6
    return out


def _peak_rss() -> int:
    """This process's peak RSS in bytes. On Linux ru_maxrss survives exec, so a worker would
    report its parent's peak when that was higher; VmHWM belongs to this address space alone."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _run_edgeinfer(
    path: str, threads: int, ids: list[int], gen: int, t_spawn: float, kv: str = "f16"
) -> dict:
    from edgeinfer import LLM, SamplingParams
    from edgeinfer.config import PREFILL_CHUNK

    t0 = time.perf_counter()
    llm = LLM(path, threads=threads, ctx=len(ids) + gen + 16, kv_dtype=kv)
    load_s = time.perf_counter() - t0
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([ids[:16]], SamplingParams(max_tokens=1, **greedy))  # also the warm-up
    start_s = time.time() - t_spawn
    # the timed request's kernels (a full prompt step, decode steps), where Numba's disk cache
    # lacks them, would otherwise compile inside it: up to one step of the prompt (a longer one
    # is prefilled in such steps), rotated by a token so that the prefix cache serves none of it
    warm = (ids[1:] + ids[:1])[:PREFILL_CHUNK]
    llm.generate([warm], SamplingParams(max_tokens=4, **greedy))
    m = llm.generate([ids], SamplingParams(max_tokens=gen, **greedy))[0].metrics
    return {
        "start_s": start_s,
        "load_s": load_s,
        "prefill_tok_s": m.prefill_tok_s,
        "ttft_s": m.ttft_s,
        "decode_tok_s": m.decode_tok_s,
    }


def _run_llama_cpp(
    path: str, threads: int, ids: list[int], gen: int, t_spawn: float, kv: str = "f16"
) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    # llama.cpp's default micro-batch of 512 tokens (one prefill chunk, as edgeinfer's); a
    # longer one would size its attention buffers for the whole prompt at once
    batch = min(len(ids), 512)
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=len(ids) + gen + 16,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=0,
        verbose=False,
        type_k=LLAMA_KV_TYPES[kv],
        type_v=LLAMA_KV_TYPES[kv],
        flash_attn=kv not in ("f16", "f32"),  # llama.cpp's quantized V cache needs it
        swa_full=False,  # llama-cli's and llama-server's default: sliding layers keep a window
    )
    load_s = time.perf_counter() - t0
    ctx, n_vocab = llm.ctx, llm.n_vocab()

    # The low-level calls, not Llama.eval: eval copies every step's logits into a
    # [n_batch, vocab] score matrix, which would add time and RSS that llama.cpp itself has not.
    def decode(tokens: list[int]) -> int:
        """Append tokens to sequence 0 -> greedy next token."""
        for i in range(0, len(tokens), batch):
            part = tokens[i : i + batch]
            arr = (llama_cpp.llama_token * len(part))(*part)
            if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(part))) != 0:
                raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(np.argmax(logits))

    decode(ids[:16])  # also the warm-up
    start_s = time.time() - t_spawn
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    t0 = time.perf_counter()
    token = decode(ids)
    t_first = time.perf_counter()
    for _ in range(gen - 1):
        token = decode([token])
    t_end = time.perf_counter()
    return {
        "start_s": start_s,
        "load_s": load_s,
        "prefill_tok_s": len(ids) / (t_first - t0),
        "ttft_s": t_first - t0,
        "decode_tok_s": (gen - 1) / (t_end - t_first),
    }


@contextmanager
def ids_on_disk(ids: list[int]):
    """-> the path of a temporary JSON file holding ids (the workers' prompt), removed after."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    try:
        yield f.name
    finally:
        os.unlink(f.name)


def warm_kernels(path: Path, threads: int, ids: list[int], kv: str = "f16") -> None:
    """One unmeasured edgeinfer worker on the start of ids (two prompt chunks, a few decode
    steps): a kernel Numba's disk cache lacks (a fresh machine, an edited kernel) compiles here,
    not inside a measured round, whose start-up and peak RSS (the highest round's) would count
    the compiler."""
    from edgeinfer.config import PREFILL_CHUNK

    with ids_on_disk(ids[: PREFILL_CHUNK + 16]) as ids_path:
        _spawn("edgeinfer", path, threads, ids_path, 4, kv)


def _spawn(engine: str, path: Path, threads: int, ids_file: str, gen: int, kv="f16") -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, str(path), str(threads), ids_file]
    cmd += [str(gen), repr(time.time()), kv]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{engine} worker failed on {path.name}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _profile(model: str, threads: int) -> str:
    cmd = [sys.executable, str(HERE / "profile_decode.py"), model, "--threads", str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else f"profile failed:\n{r.stderr[-2000:]}"


def best_of(rounds: list[dict]) -> dict:
    """One engine's rounds -> each figure at its best (speeds highest, times lowest), peak RSS
    at its highest, and every round's decode tok/s."""
    best = {k: max(r[k] for r in rounds) for k in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb")}
    best.update({k: min(r[k] for r in rounds) for k in ("ttft_s", "load_s", "start_s")})
    best["decode_rounds"] = [r["decode_tok_s"] for r in rounds]
    return best


def compare(
    models, threads_list, n_prompt: int, gen: int, rounds: int, profile: bool
) -> list[dict]:
    from edgeinfer.gguf.hub import resolve_model

    sys.path.insert(0, str(HERE))
    from bandwidth import read_bandwidth  # numba: kept out of the engines' workers

    rows = []
    bw = {t: read_bandwidth(t) for t in threads_list}
    for model in models:
        path = resolve_model(model)
        weights, kv = decode_bytes(path, n_prompt + gen // 2)
        ids = prompt_ids(path, n_prompt)
        warm_kernels(path, threads_list[0], ids)
        with ids_on_disk(ids) as ids_path:
            for t in threads_list:
                case = {
                    "model": model,
                    "threads": t,
                    "bandwidth_gb_s": bw[t] / 1e9,
                    "weights_mb": weights / 1e6,
                    "kv_mb": kv / 1e6,
                    "roofline_tok_s": bw[t] / (weights + kv),
                }
                runs = {engine: [] for engine in ENGINES}
                for i in range(rounds):
                    for engine in ENGINES if i % 2 == 0 else ENGINES[::-1]:
                        runs[engine].append(_spawn(engine, path, t, ids_path, gen))
                for engine in ENGINES:
                    r = best_of(runs[engine])
                    r["roofline_share"] = r["decode_tok_s"] / case["roofline_tok_s"]
                    case[engine] = r
                case["prefill_ratio"] = (
                    case["edgeinfer"]["prefill_tok_s"] / case["llama.cpp"]["prefill_tok_s"]
                )
                case["decode_ratio"] = (
                    case["edgeinfer"]["decode_tok_s"] / case["llama.cpp"]["decode_tok_s"]
                )
                if profile:
                    case["profile"] = _profile(model, t)
                rows.append(case)
    return rows


def markdown(rows: list[dict], n_prompt: int, gen: int) -> str:
    lines = [
        f"| model | threads | engine | prefill pp{n_prompt} tok/s | TTFT ms "
        f"| decode tg{gen} tok/s | decode % roofline | peak RSS MB | load s | start s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in rows:
        for engine in ENGINES:
            r = c[engine]
            lines.append(
                f"| {c['model']} | {c['threads']} | {engine} | {r['prefill_tok_s']:.0f} "
                f"| {r['ttft_s'] * 1e3:.0f} | {r['decode_tok_s']:.1f} "
                f"| {r['roofline_share']:.0%} | {r['peak_rss_mb']:.0f} | {r['load_s']:.1f} "
                f"| {r['start_s']:.2f} |"
            )
        lines.append(
            f"| {c['model']} | {c['threads']} | **edgeinfer / llama.cpp** "
            f"| **{c['prefill_ratio']:.2f}x** | | **{c['decode_ratio']:.2f}x** | | | | |"
        )
    lines.append("")
    for c in rows:
        lines.append(
            f"- {c['model']}, {c['threads']} thread(s): {c['weights_mb']:.0f} MB weights + "
            f"{c['kv_mb']:.1f} MB KV read per decode step; bandwidth {c['bandwidth_gb_s']:.1f} GB/s"
            f" -> roofline {c['roofline_tok_s']:.0f} tok/s; decode tok/s by round: "
            + "; ".join(
                f"{e} " + ", ".join(f"{v:.1f}" for v in c[e]["decode_rounds"]) for e in ENGINES
            )
        )
    for c in rows:
        if "profile" in c:
            lines += ["", c["profile"].rstrip()]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        engine, path, threads, ids_file, gen, t_spawn, kv = sys.argv[2:9]
        out = _worker(engine, path, int(threads), ids_file, int(gen), float(t_spawn), kv)
        print(json.dumps(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="turns each engine takes")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--profile", action="store_true", help="add the per-step decode profile")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rows = compare(
        args.models, args.threads, args.prompt_tokens, args.gen_tokens, args.rounds, args.profile
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(markdown(rows, args.prompt_tokens, args.gen_tokens))


if __name__ == "__main__":
    main()
