"""Human-readable sizes and counts, shared by the command-line output and the chat app."""

from __future__ import annotations

import re

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", re.IGNORECASE)


def human_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def human_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} K"


def parse_bytes(text: str) -> int:
    """'512M', '1.5GiB', '2g', '4096' -> bytes. K/M/G/T are powers of 1024, as for memory in
    Ollama and llama.cpp (`-b`, `--cache-ram`)."""
    m = _SIZE.fullmatch(text)
    if not m or (m[3] and not m[2] and m[3].lower() != "b"):
        raise ValueError(f"not a size: {text!r} (examples: 512M, 1.5G, 2GiB)")
    power = " kmgt".index(m[2].lower() or " ")
    return int(float(m[1]) * 1024**power)
