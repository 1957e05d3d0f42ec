"""Tokenizer throughput: edgeinfer vs llama.cpp (llama-cpp-python) on the same GGUF files.

Encodes ~1 MB of mixed text (English prose and Python code from the standard library's own
docstrings and sources, generated CJK and emoji text) with both, checks that the ids agree, and
prints MB/s side by side with the ratio. Usage:

    python bench/tokenizer.py [MODEL ...] [--mb 1.0] [--repeat 3] [--json]

MODEL: a short name known to edgeinfer.gguf.hub or a path; default both real models.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

DEFAULT_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
_CJK_WORDS = (
    "我们", "今天", "天气", "很好", "学习", "中文", "模型", "推理", "计算机", "程序",
    "数据", "东京", "日本語", "ひらがな", "カタカナ", "テスト", "한국어", "안녕하세요",
    "서울", "감사합니다",
)  # fmt: skip
_CJK_PUNCT = ("，", "。", "、", "！", "？", "：", "「", "」")
_EMOJI = "😀😂🥲😍🤖🦙🚀🔥✨🎉👍🏽👩‍💻🇯🇵❤️🧪📈🌍⭐☕"


def mixed_text(n_bytes: int, seed: int = 0) -> str:
    """About n_bytes of UTF-8: 45 % prose, 35 % code, 12 % CJK, 8 % emoji-laden chat."""
    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    rng.shuffle(files)
    prose, code = [], []
    n_prose = n_code = 0
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if n_code < 0.35 * n_bytes:
            code.append(source)
            n_code += len(source.encode())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and n_prose < 0.45 * n_bytes:
                    prose.append(doc)
                    n_prose += len(doc.encode())
        if n_code >= 0.35 * n_bytes and n_prose >= 0.45 * n_bytes:
            break
    cjk = []
    n_cjk = 0
    while n_cjk < 0.12 * n_bytes:
        sentence = "".join(rng.choice(_CJK_WORDS) for _ in range(rng.randint(3, 12)))
        sentence += rng.choice(_CJK_PUNCT)
        cjk.append(sentence)
        n_cjk += len(sentence.encode())
    chat = []
    n_chat = 0
    while n_chat < 0.08 * n_bytes:
        words = [rng.choice(prose).split()[:1] or ["ok"] for _ in range(rng.randint(2, 8))]
        line = " ".join(w[0] for w in words) + " " + "".join(rng.sample(_EMOJI, 3)) + "\n"
        chat.append(line)
        n_chat += len(line.encode())
    blocks = prose + code + ["".join(cjk[i : i + 20]) for i in range(0, len(cjk), 20)] + chat
    rng.shuffle(blocks)
    return "\n\n".join(blocks).encode()[:n_bytes].decode("utf-8", "ignore")


def _best_rate(fn, n_bytes: int, repeat: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best / 1e6, result


def bench_model(model: str, text: str, repeat: int) -> dict:
    import llama_cpp

    from edgeinfer.gguf.hub import resolve_model
    from edgeinfer.tokenizer import Tokenizer

    path = resolve_model(model)
    data = text.encode()
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(path)
    load_s = time.perf_counter() - t0
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    cap = len(data) + 8
    buf = (llama_cpp.llama_token * cap)()

    def llama_cpp_encode():  # one llama_tokenize call into a buffer big enough
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, cap, True, False)
        return buf[:n]

    def cold():  # every timed run starts without memoized words, as on new text
        tok.clear_cache()
        return tok.encode(text)

    ours, ids = _best_rate(cold, len(data), repeat)
    warm, _ = _best_rate(lambda: tok.encode(text), len(data), 1)
    theirs, ref = _best_rate(llama_cpp_encode, len(data), repeat)
    return {
        "model": model,
        "bytes": len(data),
        "tokens": len(ref),
        "edgeinfer_mb_s": round(ours, 3),
        "edgeinfer_warm_cache_mb_s": round(warm, 3),
        "llama_cpp_mb_s": round(theirs, 3),
        "ratio": round(ours / theirs, 3),
        "ids_equal": ids == ref,
        "load_s": round(load_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    ap.add_argument("--mb", type=float, default=1.0, help="text size in MB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs, best kept (default 3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    text = mixed_text(int(args.mb * 1e6))
    results = [bench_model(m, text, args.repeat) for m in args.models]
    if args.json:
        print(json.dumps({"benchmark": "tokenizer-encode", "results": results}, indent=2))
    else:
        print(f"{'model':24} {'MB':>5} {'edgeinfer MB/s':>15} {'llama.cpp MB/s':>15} "
              f"{'ratio':>6}  ids equal")  # fmt: skip
        for r in results:
            print(f"{r['model']:24} {r['bytes'] / 1e6:5.2f} {r['edgeinfer_mb_s']:15.2f} "
                  f"{r['llama_cpp_mb_s']:15.2f} {r['ratio']:6.2f}  {r['ids_equal']}")  # fmt: skip
    return 0 if all(r["ids_equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
