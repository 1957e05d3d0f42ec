"""llama.cpp's own quantizer (`llama_model_quantize`, its per-tensor type choices included),
with the checks and clean failure a command needs: the source is validated first, the output is
written to a temporary file beside DST and renamed only on success, so a failure (a full disk,
an error inside llama.cpp) never leaves a partial DST behind.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import EdgeInferError
from edgeinfer.eval.weights import bits_per_weight, describe
from edgeinfer.gguf.reader import read_gguf

# The file types `edgeinfer quantize` offers -> llama.cpp's LLAMA_FTYPE_MOSTLY_* name.
TYPES = (
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M",
    "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16",
)  # fmt: skip
FLOAT_TYPES = {"F32", "F16", "BF16"}
_PROGRESS = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
_ERROR_LEVELS = {3, 4}  # ggml's WARN and ERROR


@dataclass(frozen=True)
class Quantized:
    path: Path
    type: str
    size: int  # bytes of the output file
    bits_per_weight: float
    source_size: int
    source_bits_per_weight: float
    summary: str  # the output's tensor types and bits per weight, one line


def check_type(name: str) -> str:
    t = name.upper()
    if t not in TYPES:
        raise EdgeInferError(f"unsupported type {name!r}; choose one of {', '.join(TYPES)}")
    return t


def quantize(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    qtype: str,
    threads: int | None = None,
    force: bool = False,
    allow_requantize: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> Quantized:
    """Quantize the GGUF model at src into dst with llama.cpp's quantizer -> what was written.

    progress(i, n, tensor) is called as llama.cpp works through the n tensors.
    """
    qtype = check_type(qtype)
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise EdgeInferError(f"{src}: no such file")
    g = read_gguf(src)  # a malformed source fails here with the field named, not in llama.cpp
    source_bpw = bits_per_weight(g)
    quantized = sorted({t.qtype.name for t in g.tensors.values() if len(t.shape) > 1} - FLOAT_TYPES)
    g.close()
    if quantized and not allow_requantize:
        raise EdgeInferError(
            f"{src} is already quantized ({', '.join(quantized)}): quantize from an F32, F16 "
            "or BF16 file, or pass --allow-requantize to accept the extra error"
        )
    if dst.resolve() == src.resolve():
        raise EdgeInferError(f"{dst}: the output would overwrite the source")
    if dst.exists() and not force:
        raise EdgeInferError(f"{dst} exists; pass --force to overwrite it")
    if not dst.parent.is_dir():
        raise EdgeInferError(f"{dst.parent}: no such directory")
    threads = threads or os.cpu_count() or 1
    if threads < 1:
        raise EdgeInferError(f"--threads must be >= 1 (got {threads})")

    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    errors: list[str] = []
    try:
        rc = _run(src, tmp, qtype, threads, allow_requantize, progress, errors)
        if rc != 0:
            raise EdgeInferError(_failure(dst, errors))
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    out = read_gguf(dst)
    summary, bpw = describe(out), bits_per_weight(out)
    out.close()
    return Quantized(dst, qtype, dst.stat().st_size, bpw, src.stat().st_size, source_bpw, summary)


def _failure(dst: Path, errors: list[str]) -> str:
    # llama.cpp writes with fail-fast streams: a full disk surfaces as a generic I/O error, so
    # look at the disk while the partial file still fills it.
    if shutil.disk_usage(dst.parent).free < 1 << 20:
        return f"{dst}: no space left on device (the partial output was removed)"
    detail = errors[-1] if errors else "no message"
    return f"llama.cpp's quantizer failed: {detail} (no output written)"


def _run(src, dst, qtype, threads, allow_requantize, progress, errors) -> int:
    import llama_cpp

    pending = [""]  # llama.cpp logs a line in pieces

    @llama_cpp.llama_log_callback
    def on_log(level, text, _user):
        pending[0] += text.decode("utf-8", "replace")
        if not pending[0].endswith("\n"):
            return
        for line in pending[0].splitlines():
            m = _PROGRESS.match(line)
            if m and progress is not None:
                progress(int(m[1]), int(m[2]), m[3])
            elif level in _ERROR_LEVELS and line.strip():
                errors.append(line.strip())
        pending[0] = ""

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = threads
    params.allow_requantize = allow_requantize
    llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
    try:
        return llama_cpp.llama_model_quantize(
            str(src).encode(), str(dst).encode(), ctypes.byref(params)
        )
    finally:
        from llama_cpp import _logger

        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
