"""Which layers run on which ggml backend: `--offload`, `--gpu-layers` and `--rpc`.

Pure parsing, no ggml: EngineConfig validates the text once, and the runner resolves it against
the model's layer count when it loads. `--offload` is one or more comma-separated
LAYERS@BACKEND spans; LAYERS is `A-B` (inclusive), `A`, or `all` (every layer and the head);
`+head` after a span that ends at the last layer also moves the output norm and head. BACKEND is
`cpu` (ggml's CPU backend), `cuda[:N]`, or `rpc:HOST:PORT` (a ggml RPC server, `edgeinfer
rpc-server`). Several spans must follow one another (together they are one run of layers, as
llama.cpp places its devices' layers after its CPU ones), so the model sees one span.
`--gpu-layers N` is llama.cpp's `-ngl N`: the last N layers on `cuda`, the head too once N covers
every layer. `--rpc HOST:PORT[,...]` lists ggml RPC servers; without `--offload` the last N
layers (every layer and the head without `--gpu-layers`) are split among them in proportion to
each server's free memory, as llama.cpp splits layers among its devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edgeinfer.config import ConfigError

_SPEC = re.compile(r"^(?:(?P<all>all)|(?P<a>\d+)(?:-(?P<b>\d+))?(?P<head>\+head)?)@(?P<be>.+)$")
_BACKEND = re.compile(r"^(?:cpu|cuda(?::\d+)?|rpc:.+)$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")  # IPv4 or a host name: ggml's RPC
GPU_BACKEND = "cuda"
RPC = "rpc:"


class PlacementError(ConfigError):
    """An offload request that cannot be met: bad syntax, layers out of range."""


@dataclass(frozen=True)
class Span:
    """Layers [first, stop) on `backend`; head: the output norm and head run there too.
    parts: the spans on each backend, in layer order, when several backends share this one."""

    first: int
    stop: int
    head: bool
    backend: str
    parts: tuple[Span, ...] = ()

    @property
    def pieces(self) -> tuple[Span, ...]:
        return self.parts or (self,)

    def describe(self) -> str:
        if self.parts:
            return "; ".join(p.describe() for p in self.parts)
        layers = f"layer {self.first}" if self.stop - self.first == 1 else "layers "
        if self.stop - self.first > 1:
            layers += f"{self.first}-{self.stop - 1}"
        b = self.backend
        where = f"ggml RPC server {endpoint(b)}" if is_rpc(b) else f"ggml {b}"
        return f"{layers}{' + head' if self.head else ''} on {where}"


def is_rpc(backend: str) -> bool:
    return backend.startswith(RPC)


def endpoint(backend: str) -> str:
    return backend[len(RPC) :]


def check_endpoint(text: str) -> str:
    """HOST:PORT of a ggml RPC server (ggml speaks IPv4: an address or a host name)."""
    host, sep, port = text.strip().rpartition(":")
    if not (sep and _HOST.match(host) and port.isdigit() and 0 < int(port) < 65536):
        raise PlacementError(
            f"RPC server {text!r}: expected HOST:PORT, e.g. 192.168.1.20:50052 (an IPv4 address "
            "or a host name)"
        )
    return f"{host}:{int(port)}"


def check_backend(name: str) -> str:
    if not _BACKEND.match(name):
        raise PlacementError(
            f"unknown ggml backend {name!r} (use cpu, cuda, cuda:N or rpc:HOST:PORT)"
        )
    if is_rpc(name):
        return RPC + check_endpoint(endpoint(name))
    return name


def check_rpc(text: str) -> list[str]:
    """--rpc HOST:PORT[,HOST:PORT...] -> the endpoints, each once."""
    eps = [check_endpoint(t) for t in text.split(",") if t.strip()]
    if not eps:
        raise PlacementError("--rpc: expected HOST:PORT[,HOST:PORT...]")
    if len(set(eps)) != len(eps):
        raise PlacementError(f"--rpc {text!r} names a server twice")
    return eps


def check_offload(text: str) -> str:
    """Syntax only (the layer count is known once the model loads)."""
    for spec in text.split(","):
        m = _SPEC.match(spec.strip())
        if not m:
            raise PlacementError(
                f"--offload {spec!r}: expected LAYERS@BACKEND, e.g. 12-29@cuda:0, 0-5@cpu, "
                "20-29+head@cuda, all@cuda or 8-15@rpc:192.168.1.20:50052 (several spans: "
                "comma-separated)"
            )
        check_backend(m["be"])
        if m["b"] is not None and int(m["b"]) < int(m["a"]):
            raise PlacementError(f"--offload {spec!r}: the span {m['a']}-{m['b']} is empty")
    return text.strip()


def _one(spec: str, n_layers: int) -> Span:
    m = _SPEC.match(spec.strip())
    backend = check_backend(m["be"])
    if m["all"]:
        return Span(0, n_layers, True, backend)
    first = int(m["a"])
    last = int(m["b"]) if m["b"] is not None else first
    if last >= n_layers:
        raise PlacementError(
            f"--offload {spec}: layer {last} is out of range (the model has layers "
            f"0-{n_layers - 1})"
        )
    if m["head"] and last != n_layers - 1:
        raise PlacementError(
            f"--offload {spec}: +head needs the span to end at the last layer, {n_layers - 1}"
        )
    return Span(first, last + 1, bool(m["head"]), backend)


def _joined(parts: list[Span]) -> Span:
    """Spans in layer order that follow one another -> one span made of them."""
    parts.sort(key=lambda s: s.first)
    for a, b in zip(parts, parts[1:], strict=False):
        if b.first != a.stop:
            problem = "overlap" if b.first < a.stop else "leave a gap"
            raise PlacementError(
                f"--offload: the spans {a.describe()} and {b.describe()} {problem}; ggml spans "
                "must follow one another (edgeinfer's kernels run the layers before and after)"
            )
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    return Span(parts[0].first, last.stop, last.head, "+".join(p.backend for p in parts),
                tuple(parts))  # fmt: skip


def split_by_memory(first: int, n_layers: int, head: bool, free: dict[str, int]) -> Span:
    """Layers [first, n_layers) (and the head) over the RPC servers of `free` (endpoint -> free
    bytes), each a share proportional to its free memory (cumulative rounding, as llama.cpp's
    tensor split); a server whose share rounds to no layer gets none."""
    total = sum(free.values())
    if total <= 0:
        raise PlacementError("the RPC servers report no free memory")
    parts, start, acc = [], first, 0
    for ep, mem in free.items():
        acc += mem
        stop = first + round((n_layers - first) * acc / total)
        if stop > start:
            parts.append(Span(start, stop, False, RPC + ep))
        start = max(start, stop)
    parts[-1] = Span(parts[-1].first, n_layers, head, parts[-1].backend)
    return _joined(parts)


def rpc_endpoints(offload: str | None, rpc: str | None) -> list[str]:
    """The RPC servers a placement uses (to probe them before anything else)."""
    eps = check_rpc(rpc) if rpc else []
    for spec in (offload or "").split(","):
        m = _SPEC.match(spec.strip())
        if m and is_rpc(m["be"]):
            ep = endpoint(check_backend(m["be"]))
            if ep not in eps:
                eps.append(ep)
    return eps


def resolve(
    offload: str | None,
    gpu_layers: int | None,
    n_layers: int,
    rpc: str | None = None,
    free: dict[str, int] | None = None,
) -> Span | None:
    """The span for a model of n_layers, or None when every layer stays on edgeinfer's kernels.
    free: each --rpc server's free memory (endpoint -> bytes), for the automatic split."""
    servers = check_rpc(rpc) if rpc else []
    if offload is not None:
        span = _joined([_one(s, n_layers) for s in check_offload(offload).split(",")])
        named = {endpoint(p.backend) for p in span.pieces if is_rpc(p.backend)}
        unused = [ep for ep in servers if ep not in named]
        if servers and (unused or named - set(servers)):
            raise PlacementError(
                f"--rpc lists {', '.join(servers)} but --offload places layers on "
                f"{', '.join(sorted(named)) or 'none of them'}: name each server in both"
            )
        return span
    if servers:
        n = n_layers if gpu_layers is None else min(gpu_layers, n_layers)
        if n == 0:
            return None
        head = gpu_layers is None or gpu_layers >= n_layers
        return split_by_memory(n_layers - n, n_layers, head, {ep: free[ep] for ep in servers})
    if not gpu_layers:
        return None
    n = min(gpu_layers, n_layers)
    return Span(n_layers - n, n_layers, gpu_layers >= n_layers, GPU_BACKEND)
