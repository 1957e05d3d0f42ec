"""A GGUF reader that validates before it trusts: every count, length, type and offset in the
file is checked against the bytes actually present, with Python ints (never wrapping numpy
integers), so a hostile or damaged file gives one `GGUFError` line instead of a hang, a huge
allocation, a numpy traceback or a crash inside a kernel later.

Format (v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 metadata count,
the metadata (key string, u32 value type, value), the tensor infos (name string, u32 n_dims,
n_dims x u64 ne, u32 ggml type, u64 offset relative to the data section), then the data section,
which starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgeinfer.errors import GGUFError
from edgeinfer.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from edgeinfer.gguf.tensor_types import SUPPORTED_TENSOR_TYPES

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# An array of arrays is legal GGUF but nothing real nests deeper; a bound stops recursion bombs.
MAX_ARRAY_DEPTH = 3
MAX_DIMS = 4


V = GGUFValueType
# Fixed-size value types: struct format for scalars, numpy dtype for arrays.
_SCALAR_FORMATS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h",
    V.UINT32: "<I", V.INT32: "<i", V.UINT64: "<Q", V.INT64: "<q",
    V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<B",
}  # fmt: skip
_SCALAR_STRUCTS = {vt: struct.Struct(fmt) for vt, fmt in _SCALAR_FORMATS.items()}
_ARRAY_DTYPES = {vt: np.dtype(fmt) for vt, fmt in _SCALAR_FORMATS.items()}
INTEGER_VALUE_TYPES = frozenset(
    {V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64}
)
# Fewest bytes one element of each type can take: a claimed count times this must fit in the
# bytes left, which makes a 2^63-element claim fail before anything is allocated or looped.
_MIN_ELEMENT_SIZE = {vt: dt.itemsize for vt, dt in _ARRAY_DTYPES.items()}
_MIN_ELEMENT_SIZE[V.STRING] = 8  # u64 length, possibly empty
_MIN_ELEMENT_SIZE[V.ARRAY] = 12  # u32 element type + u64 count
_MIN_KV_SIZE = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # rows-first numpy order = GGUF ne reversed; a weight is (out, in)
    offset: int  # absolute byte offset in the file
    nbytes: int
    n_elements: int


class GGUFFile:
    """A validated GGUF file: metadata as Python values, tensors as views of the mapped file."""

    def __init__(
        self,
        path: Path,
        version: int,
        alignment: int,
        file_size: int,
        data_offset: int,
        metadata: dict[str, Any],
        value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]],
        tensors: dict[str, TensorInfo],
        data: np.memmap,
    ):
        self.path = path
        self.version = version
        self.alignment = alignment
        self.file_size = file_size
        self.data_offset = data_offset
        self.metadata = metadata
        self.value_types = value_types
        self.tensors = tensors
        self._data: np.memmap | None = data

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(self.path, "general.architecture: missing or not a string")
        return arch

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes: a zero-copy uint8 view into the memory-mapped file."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, f"tensor {_show(name)}: not in the file")
        if self._data is None:
            raise GGUFError(self.path, "file was closed")
        return self._data[info.offset : info.offset + info.nbytes].view(np.ndarray)

    def contiguous_data(self, names: list[str]) -> np.ndarray | None:
        """The raw bytes of several tensors stored back to back in this order, as one zero-copy
        view (None if they are not adjacent in the file)."""
        infos = [self.tensors[n] for n in names]
        if any(b.offset != a.offset + a.nbytes for a, b in zip(infos[:-1], infos[1:], strict=True)):
            return None
        if self._data is None:
            raise GGUFError(self.path, "file was closed")
        return self._data[infos[0].offset : infos[-1].offset + infos[-1].nbytes].view(np.ndarray)

    def close(self) -> None:
        # Views handed out by tensor_data keep the mapping alive until they are dropped;
        # this only releases the file's own reference.
        self._data = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, "
            f"{len(self.tensors)} tensors)"
        )


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate a GGUF file; raises GGUFError naming the field and defect."""
    path = Path(path)
    # Parse through a plain mmap (slicing it gives bytes, the fastest way to decode a big
    # vocabulary), then map the validated file again as the np.memmap the tensors view.
    with _map_file(path) as mapped:
        cur = _Cursor(path, mapped)
        version, n_tensors, n_kv = _read_header(cur)
        metadata, value_types = _read_metadata(cur, n_kv)
        alignment = _alignment(cur, metadata, value_types)
        raw_infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
        _check_unique_names(cur, raw_infos)
        # llama.cpp pads to the data section only when there are tensors; so do we.
        data_offset = _align_up(cur.pos, alignment) if raw_infos else cur.pos
        tensors = _place_tensors(cur, raw_infos, data_offset, alignment)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise GGUFError(path, f"cannot map: {e}") from None
    if len(data) != cur.end:
        raise GGUFError(path, "file changed while it was being read")
    return GGUFFile(
        path, version, alignment, cur.end, data_offset, metadata, value_types, tensors, data
    )


def _map_file(path: Path) -> mmap.mmap:
    try:
        # Check before opening: opening a FIFO would block forever.
        if not stat.S_ISREG(path.stat().st_mode):
            raise GGUFError(path, "not a regular file")
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise GGUFError(path, "file is empty")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(path, f"cannot open: {e.strerror or e}") from None


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; errors name the field read."""

    def __init__(self, path: Path, buf: mmap.mmap):
        self.path = path
        self.buf = buf
        self.pos = 0
        self.end = len(buf)

    @property
    def left(self) -> int:
        return self.end - self.pos

    def error(self, field: str, defect: str) -> GGUFError:
        return GGUFError(self.path, f"{field}: {defect}")

    def need(self, n: int, field: str) -> None:
        if n > self.left:
            raise self.error(
                field, f"truncated file: needs {n} bytes at offset {self.pos}, {self.left} left"
            )

    def unpack(self, st: struct.Struct, field: str) -> Any:
        self.need(st.size, field)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def u32(self, field: str) -> int:
        return self.unpack(_U32, field)

    def u64(self, field: str) -> int:
        return self.unpack(_U64, field)

    def i64(self, field: str) -> int:
        return self.unpack(_I64, field)

    def raw(self, n: int, field: str) -> bytes:
        self.need(n, field)
        chunk = self.buf[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def string(self, field: str) -> str:
        n = self.u64(f"{field} length")
        if n > self.left:
            raise self.error(field, f"string length {n} exceeds the {self.left} bytes left")
        return self.decode(self.raw(n, field), field)

    def decode(self, raw: bytes, field: str) -> str:
        try:
            return raw.decode()
        except UnicodeDecodeError as e:
            raise self.error(field, f"invalid UTF-8 at byte {e.start}") from None

    def value_type(self, field: str) -> GGUFValueType:
        type_id = self.u32(f"{field} type")
        try:
            return GGUFValueType(type_id)
        except ValueError:
            raise self.error(field, f"unknown value type {type_id}") from None

    def count(self, field: str, min_size: int, what: str) -> int:
        """A u64 element count, bounded by how many of the smallest element fit in the file."""
        n = self.u64(field)
        if n * min_size > self.left:
            raise self.error(
                field, f"claims {n} {what}, more than the {self.left} bytes left can hold"
            )
        return n


def _show(s: str, limit: int = 80) -> str:
    """A file-provided string quoted for a one-line message (repr escapes newlines)."""
    return repr(s if len(s) <= limit else s[: limit - 3] + "...")


def _read_header(cur: _Cursor) -> tuple[int, int, int]:
    magic = cur.raw(4, "magic")
    if magic != GGUF_MAGIC:
        raise cur.error("magic", f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 and version else ""
        raise cur.error("version", f"unsupported GGUF version {version}{hint}; supported: 2, 3")
    n_tensors = cur.count("tensor count", _MIN_TENSOR_INFO_SIZE, "tensors")
    n_kv = cur.count("metadata count", _MIN_KV_SIZE, "key-value pairs")
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int):
    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        field = f"metadata {_show(key)}"
        if not key:
            raise cur.error(f"metadata key #{i}", "empty key")
        if key in metadata:
            raise cur.error(field, "duplicate key")
        vtype = cur.value_type(field)
        if vtype == V.ARRAY:
            value, etype = _read_array(cur, field, depth=1)
        else:
            value, etype = _read_scalar(cur, vtype, field), None
        metadata[key] = value
        value_types[key] = (vtype, etype)
    return metadata, value_types


def _read_scalar(cur: _Cursor, vtype: GGUFValueType, field: str) -> Any:
    if vtype == V.STRING:
        return cur.string(field)
    value = cur.unpack(_SCALAR_STRUCTS[vtype], field)
    # llama.cpp reads a bool byte as "nonzero is true"; do the same.
    return value != 0 if vtype == V.BOOL else value


def _read_array(cur: _Cursor, field: str, depth: int) -> tuple[Any, GGUFValueType]:
    """An array value and its element type: strings -> list[str], numbers -> numpy copy."""
    if depth > MAX_ARRAY_DEPTH:
        raise cur.error(field, f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
    etype = cur.value_type(f"{field} array element")
    n = cur.count(f"{field} array length", _MIN_ELEMENT_SIZE[etype], f"{etype.name} elements")
    if etype == V.STRING:
        return _read_string_array(cur, field, n), etype
    if etype == V.ARRAY:
        return [_read_array(cur, f"{field}[{i}]", depth + 1)[0] for i in range(n)], etype
    dtype = _ARRAY_DTYPES[etype]
    values = np.frombuffer(cur.raw(n * dtype.itemsize, field), dtype=dtype)
    if etype == V.BOOL:
        return values != 0, etype
    return values.astype(dtype.newbyteorder("="), copy=True), etype


def _read_string_array(cur: _Cursor, field: str, n: int) -> list[str]:
    # Tight loop over locals: a 262k-token vocabulary must parse in well under a second.
    buf, pos, end = cur.buf, cur.pos, cur.end
    unpack = _U64.unpack_from
    out = []
    append = out.append
    for i in range(n):
        if end - pos < 8:
            cur.pos = pos
            cur.need(8, f"{field}[{i}] length")
        (length,) = unpack(buf, pos)
        pos += 8
        if length > end - pos:
            raise cur.error(f"{field}[{i}]", f"string length {length} exceeds the bytes left")
        try:
            append(buf[pos : pos + length].decode())
        except UnicodeDecodeError as e:
            raise cur.error(f"{field}[{i}]", f"invalid UTF-8 at byte {e.start}") from None
        pos += length
    cur.pos = pos
    return out


def _alignment(cur: _Cursor, metadata: dict, value_types: dict) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    vtype, _ = value_types["general.alignment"]
    if vtype not in INTEGER_VALUE_TYPES:
        raise cur.error("general.alignment", f"must be an integer, not {vtype.name}")
    alignment = metadata["general.alignment"]
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.error("general.alignment", f"{alignment} is not a power of two")
    return alignment


@dataclass(frozen=True)
class _RawTensorInfo:
    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]  # GGUF order: ne[0] is the row length
    rel_offset: int


def _read_tensor_info(cur: _Cursor, index: int) -> _RawTensorInfo:
    name = cur.string(f"tensor #{index} name")
    field = f"tensor {_show(name)}"
    n_dims = cur.u32(f"{field} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(field, f"{n_dims} dimensions; must be 1 to {MAX_DIMS}")
    ne = tuple(cur.i64(f"{field} dimension {j}") for j in range(n_dims))
    for j, size in enumerate(ne):
        if size <= 0:
            raise cur.error(field, f"dimension {j} is {size}; must be positive")
    type_id = cur.u32(f"{field} type")
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise cur.error(field, f"unknown tensor type id {type_id}") from None
    if qtype not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(t.name for t in sorted(SUPPORTED_TENSOR_TYPES))
        raise cur.error(
            field, f"tensor type {qtype.name} is not supported (supported: {supported})"
        )
    block_size, _ = GGML_QUANT_SIZES[qtype]
    if ne[0] % block_size:
        raise cur.error(
            field,
            f"row length {ne[0]} is not a multiple of the {qtype.name} block size {block_size}",
        )
    rel_offset = cur.u64(f"{field} offset")
    return _RawTensorInfo(name, qtype, ne, rel_offset)


def _check_unique_names(cur: _Cursor, infos: list[_RawTensorInfo]) -> None:
    seen: set[str] = set()
    for info in infos:
        if info.name in seen:
            raise cur.error(f"tensor {_show(info.name)}", "duplicate tensor name")
        seen.add(info.name)


def _place_tensors(
    cur: _Cursor, infos: list[_RawTensorInfo], data_offset: int, alignment: int
) -> dict[str, TensorInfo]:
    """Resolve each tensor's bytes; all must be aligned, inside the file, and disjoint."""
    if infos and data_offset > cur.end:
        raise cur.error("data section", f"starts at {data_offset}, past the end of the file")
    tensors: dict[str, TensorInfo] = {}
    for info in infos:
        field = f"tensor {_show(info.name)}"
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        n_elements = math.prod(info.ne)
        nbytes = n_elements // block_size * type_size
        if info.rel_offset % alignment:
            raise cur.error(field, f"data offset {info.rel_offset} is not aligned to {alignment}")
        start = data_offset + info.rel_offset
        if start + nbytes > cur.end:
            raise cur.error(
                field,
                f"data [{start}, {start + nbytes}) runs past the end of the file ({cur.end} bytes)",
            )
        shape = tuple(reversed(info.ne))
        tensors[info.name] = TensorInfo(info.name, info.qtype, shape, start, nbytes, n_elements)
    _check_disjoint(cur, tensors)
    return tensors


def _check_disjoint(cur: _Cursor, tensors: dict[str, TensorInfo]) -> None:
    by_offset = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
    for prev, cur_t in itertools.pairwise(by_offset):
        if cur_t.offset < prev.offset + prev.nbytes:
            raise cur.error(
                f"tensor {_show(cur_t.name)}", f"data overlaps tensor {_show(prev.name)}"
            )


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment
