"""GGUF header parsing speed: edgeinfer's reader against llama.cpp's (ggml's gguf_init_from_file)
and gguf-py's GGUFReader, on the same files, in the same run.

    python bench/gguf_read.py [MODEL ...] [--repeat 5] [--json]

MODEL: a short name known to edgeinfer.gguf.hub or a path; default both real models, plus a
written file holding only a Gemma 3-sized vocabulary (262,144 tokens), the metadata that
dominates `edgeinfer info` and model load. Each reader parses the whole header (metadata and
tensor infos; no tensor data is read): best of --repeat.
"""

from __future__ import annotations

import argparse
import ctypes as C
import json
import tempfile
import time
from pathlib import Path

DEFAULT_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
VOCAB = 262_144


class _InitParams(C.Structure):  # struct gguf_init_params
    _fields_ = [("no_alloc", C.c_bool), ("ctx", C.c_void_p)]


def _llama_cpp_reader():
    """ggml's own GGUF parser from llama-cpp-python's libggml-base (no tensor data: no_alloc)."""
    from edgeinfer.ggml.lib import library_dir

    base = C.CDLL(str(library_dir() / "libggml-base.so.0"))
    base.gguf_init_from_file.restype = C.c_void_p
    base.gguf_init_from_file.argtypes = [C.c_char_p, _InitParams]
    base.gguf_free.argtypes = [C.c_void_p]

    def read(path: Path) -> None:
        ctx = base.gguf_init_from_file(str(path).encode(), _InitParams(True, None))
        if not ctx:
            raise RuntimeError(f"ggml could not parse {path}")
        base.gguf_free(ctx)

    return read


def _edgeinfer_reader():
    from edgeinfer.gguf.reader import read_gguf

    def read(path: Path) -> None:
        read_gguf(path).close()

    return read


def _gguf_py_reader():
    from gguf import GGUFReader

    return lambda path: GGUFReader(path)


def vocab_file(directory: Path) -> Path:
    import gguf

    path = directory / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (1 + i % 4) for i in range(VOCAB)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def best_time(read, path: Path, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        read(path)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=list(DEFAULT_MODELS))
    ap.add_argument("--repeat", type=int, default=5, help="parses per reader and file (best)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()

    from edgeinfer.gguf.hub import resolve_model

    readers = {
        "edgeinfer": _edgeinfer_reader(),
        "llama.cpp": _llama_cpp_reader(),
        "gguf-py": _gguf_py_reader(),
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {f"{VOCAB}-token vocabulary": vocab_file(Path(tmp))}
        files.update({m: resolve_model(m) for m in args.models})
        for label, path in files.items():
            row = {"file": label}
            for name, read in readers.items():
                row[f"{name}_ms"] = best_time(read, path, args.repeat) * 1e3
            row["ratio_vs_llama_cpp"] = row["llama.cpp_ms"] / row["edgeinfer_ms"]
            results.append(row)
    if args.json:
        print(json.dumps({"results": results}))
        return
    print("| file | edgeinfer ms | llama.cpp ms | gguf-py ms | speed vs llama.cpp |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['file']} | {r['edgeinfer_ms']:.1f} | {r['llama.cpp_ms']:.1f} | "
            f"{r['gguf-py_ms']:.1f} | {r['ratio_vs_llama_cpp']:.2f}x |"
        )


if __name__ == "__main__":
    main()
