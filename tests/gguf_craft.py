"""Writes GGUF files byte by byte, defects included (gguf.GGUFWriter refuses most of them).

A `Craft` starts as a small valid file; tests change one field to make exactly one defect.
Values are given as already-encoded payloads (helpers below encode the usual ones), so a test
can claim any type id, count or length it likes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
_SCALAR_FORMATS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h",
    V.UINT32: "<I", V.INT32: "<i", V.UINT64: "<Q", V.INT64: "<q",
    V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<B",
}  # fmt: skip


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def gstr(s: str | bytes) -> bytes:
    """A GGUF string: u64 byte length, then the bytes (str is UTF-8 encoded)."""
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw)) + raw


def scalar(vtype: GGUFValueType, value) -> bytes:
    """Payload of a scalar value (without its type id)."""
    if vtype == V.STRING:
        return gstr(value)
    return struct.pack(_SCALAR_FORMATS[vtype], value)


def array(etype: GGUFValueType | int, values: list, count: int | None = None) -> bytes:
    """Payload of an array value: element type, count (claimed, default the real one), elements.

    Elements of an ARRAY-of-ARRAY are given as already-encoded payloads."""
    n = len(values) if count is None else count
    if etype == V.ARRAY:
        body = b"".join(values)
    elif etype in _SCALAR_FORMATS or etype == V.STRING:
        body = b"".join(scalar(V(etype), v) for v in values)
    else:
        body = b"".join(values)
    return u32(int(etype)) + u64(n) + body


@dataclass
class KV:
    key: str | bytes
    type_id: int
    payload: bytes


@dataclass
class Tensor:
    name: str | bytes
    ne: list[int]  # GGUF order: ne[0] is the row length
    type_id: int = int(GGMLQuantizationType.F32)
    offset: int | None = None  # relative to the data section; None = packed after the previous
    data: bytes | None = None  # None = zeros of the right size
    n_dims: int | None = None  # claimed number of dims (default len(ne))


@dataclass
class Craft:
    magic: bytes = b"GGUF"
    version: int = 3
    kvs: list[KV] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32  # used to lay out the file; add a general.alignment KV to declare it
    n_kv: int | None = None  # claimed counts (default: the real ones)
    n_tensors: int | None = None

    def kv(self, key: str | bytes, vtype: GGUFValueType | int, value) -> Craft:
        """Add a key; value is encoded for known scalar types, else taken as a raw payload."""
        payload = value if isinstance(value, bytes) and vtype != V.STRING else None
        if payload is None:
            payload = scalar(V(vtype), value)
        self.kvs.append(KV(key, int(vtype), payload))
        return self

    def kv_array(self, key: str | bytes, etype, values: list, count: int | None = None) -> Craft:
        self.kvs.append(KV(key, int(V.ARRAY), array(etype, values, count)))
        return self

    def tensor(self, name: str | bytes, ne: list[int], qtype=GGMLQuantizationType.F32, **kw):
        self.tensors.append(Tensor(name, list(ne), int(qtype), **kw))
        return self

    def build(self) -> bytes:
        out = bytearray(self.magic)
        out += u32(self.version)
        out += u64(len(self.tensors) if self.n_tensors is None else self.n_tensors)
        out += u64(len(self.kvs) if self.n_kv is None else self.n_kv)
        for kv in self.kvs:
            out += gstr(kv.key) + u32(kv.type_id) + kv.payload
        blobs, offsets = self._layout()
        for t, offset in zip(self.tensors, offsets, strict=True):
            n_dims = len(t.ne) if t.n_dims is None else t.n_dims
            out += gstr(t.name) + u32(n_dims)
            out += b"".join(struct.pack("<q", d) for d in t.ne)
            out += u32(t.type_id) + u64(offset)
        if self.tensors:
            out += bytes(-len(out) % self.alignment)
        data = bytearray()
        for blob, offset in zip(blobs, offsets, strict=True):
            if not blob:
                continue  # lets a test claim any offset without writing gigabytes
            if len(data) < offset + len(blob):
                data += bytes(offset + len(blob) - len(data))
            data[offset : offset + len(blob)] = blob
        return bytes(out + data)

    def write(self, path) -> Path:
        path = Path(path)
        path.write_bytes(self.build())
        return path

    def _layout(self) -> tuple[list[bytes], list[int]]:
        blobs, offsets, end = [], [], 0
        for t in self.tensors:
            blob = t.data if t.data is not None else bytes(_nbytes(t))
            offset = end if t.offset is None else t.offset
            blobs.append(blob)
            offsets.append(offset)
            end = offset + len(blob)
            end += -end % self.alignment
        return blobs, offsets


def _nbytes(t: Tensor) -> int:
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
    except (ValueError, KeyError):
        return 0
    n = 1
    for d in t.ne:
        n *= max(d, 0)
    # Absurd shapes (used to test overflow checks) get no data at all.
    return n // block * type_size if n < 1 << 24 else 0


def valid_craft() -> Craft:
    """A small valid file: a few keys of several types and two tensors."""
    return (
        Craft()
        .kv("general.architecture", V.STRING, "llama")
        .kv("general.name", V.STRING, "crafted")
        .kv("llama.block_count", V.UINT32, 1)
        .kv_array("tokenizer.ggml.tokens", V.STRING, ["<s>", "a", "b"])
        .kv_array("tokenizer.ggml.scores", V.FLOAT32, [0.0, -1.0, -2.0])
        .tensor("a.weight", [32, 2])
        .tensor("b.weight", [64], GGMLQuantizationType.Q8_0)
    )
