"""Which layers run on which ggml backend: `--gpu-layers N` and `--offload LAYERS@BACKEND`.

Pure parsing, no ggml: EngineConfig validates the text once, and the runner resolves it against
the model's layer count when it loads. LAYERS is `A-B` (inclusive), `A`, or `all` (every layer and
the head); `+head` after a span that ends at the last layer also moves the output norm and head.
`--gpu-layers N` is llama.cpp's `-ngl N`: the last N layers on `cuda`, the head too once N covers
every layer. BACKEND is `cpu` (ggml's CPU backend) or `cuda[:N]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeinfer.config import ConfigError

_SPEC = re.compile(r"^(?:(?P<all>all)|(?P<a>\d+)(?:-(?P<b>\d+))?(?P<head>\+head)?)@(?P<be>.+)$")
_BACKEND = re.compile(r"^(?:cpu|cuda(?::\d+)?)$")
GPU_BACKEND = "cuda"


class PlacementError(ConfigError):
    """An offload request that cannot be met: bad syntax, layers out of range."""


@dataclass(frozen=True)
class Span:
    """Layers [first, stop) on `backend`; head: the output norm and head run there too."""

    first: int
    stop: int
    head: bool
    backend: str

    def describe(self) -> str:
        layers = f"layer {self.first}" if self.stop - self.first == 1 else "layers "
        if self.stop - self.first > 1:
            layers += f"{self.first}-{self.stop - 1}"
        return f"{layers}{' + head' if self.head else ''} on ggml {self.backend}"


def check_backend(name: str) -> str:
    if not _BACKEND.match(name):
        raise PlacementError(f"unknown ggml backend {name!r} (use cpu, cuda or cuda:N)")
    return name


def check_offload(text: str) -> str:
    """Syntax only (the layer count is known once the model loads)."""
    m = _SPEC.match(text.strip())
    if not m:
        raise PlacementError(
            f"--offload {text!r}: expected LAYERS@BACKEND, e.g. 12-29@cuda:0, 0-5@cpu, "
            "20-29+head@cuda or all@cuda"
        )
    check_backend(m["be"])
    if m["b"] is not None and int(m["b"]) < int(m["a"]):
        raise PlacementError(f"--offload {text!r}: the span {m['a']}-{m['b']} is empty")
    return text.strip()


def resolve(offload: str | None, gpu_layers: int | None, n_layers: int) -> Span | None:
    """The span for a model of n_layers, or None when every layer stays on edgeinfer's kernels."""
    if offload is not None:
        m = _SPEC.match(check_offload(offload))
        if m["all"]:
            return Span(0, n_layers, True, m["be"])
        first = int(m["a"])
        last = int(m["b"]) if m["b"] is not None else first
        if last >= n_layers:
            raise PlacementError(
                f"--offload {offload}: layer {last} is out of range (the model has layers "
                f"0-{n_layers - 1})"
            )
        if m["head"] and last != n_layers - 1:
            raise PlacementError(
                f"--offload {offload}: +head needs the span to end at the last layer, "
                f"{n_layers - 1}"
            )
        return Span(first, last + 1, bool(m["head"]), m["be"])
    if not gpu_layers:
        return None
    n = min(gpu_layers, n_layers)
    return Span(n_layers - n, n_layers, gpu_layers >= n_layers, GPU_BACKEND)
