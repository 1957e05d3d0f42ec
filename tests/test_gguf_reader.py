"""The GGUF reader: valid files read back exactly; each malformed file fails fast with one line."""

from __future__ import annotations

import struct
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_craft import Craft, array, gstr, u32, u64, valid_craft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.errors import GGUFError
from edgeinfer.gguf.reader import GGUFFile, read_gguf

HUGE = 1 << 63


def expect_error(path, *fragments: str) -> None:
    """read_gguf must fail within a second with one line naming the file and the defect."""
    start = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        read_gguf(path)
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert elapsed < 1.0, f"took {elapsed:.2f} s: {message}"
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def craft_file(tmp_path: Path, craft: Craft) -> Path:
    return craft.write(tmp_path / "bad.gguf")


def test_valid_craft_reads(tmp_path):
    g = read_gguf(craft_file(tmp_path, valid_craft()))
    assert g.version == 3
    assert g.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "b"]
    assert list(g.tensors) == ["a.weight", "b.weight"]
    assert g.tensors["a.weight"].shape == (2, 32)
    assert g.tensors["b.weight"].nbytes == 2 * 34


# --- header ------------------------------------------------------------------------------------


def test_bad_magic(tmp_path):
    craft = valid_craft()
    craft.magic = b"GGML"
    expect_error(craft_file(tmp_path, craft), "magic", "not a GGUF file")


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_unsupported_version(tmp_path, version):
    craft = valid_craft()
    craft.version = version
    expect_error(craft_file(tmp_path, craft), "version", f"unsupported GGUF version {version}")


def test_big_endian_version_hint(tmp_path):
    craft = valid_craft()
    craft.version = 0x03000000
    expect_error(craft_file(tmp_path, craft), "big-endian")


def test_version_2_reads(tmp_path):
    craft = valid_craft()
    craft.version = 2
    assert read_gguf(craft_file(tmp_path, craft)).version == 2


@pytest.mark.parametrize("count", [HUGE, (1 << 64) - 1, 1000])
def test_kv_count_beyond_file(tmp_path, count):
    craft = valid_craft()
    craft.n_kv = count
    expect_error(craft_file(tmp_path, craft), "metadata count", f"claims {count} key-value")


@pytest.mark.parametrize("count", [HUGE, 1000])
def test_tensor_count_beyond_file(tmp_path, count):
    craft = valid_craft()
    craft.n_tensors = count
    expect_error(craft_file(tmp_path, craft), "tensor count", f"claims {count} tensors")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    expect_error(path, "empty")


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "cannot open")


def test_directory(tmp_path):
    expect_error(tmp_path, "not a regular file")


def test_every_truncation_fails(tmp_path):
    data = valid_craft().build()
    path = tmp_path / "cut.gguf"
    for n in range(1, len(data)):
        path.write_bytes(data[:n])
        expect_error(path)


@pytest.mark.parametrize(
    "cut, field, defect",
    [
        (6, "version", "truncated"),
        (20, "metadata count", "truncated"),
        (40, "metadata key #0", "string length 20 exceeds the 8 bytes left"),
        (60, "metadata 'general.architecture' length", "truncated"),
    ],
)
def test_truncation_names_field(tmp_path, cut, field, defect):
    # One key and no tensors, so that the count bounds do not catch the cut first.
    path = tmp_path / "cut.gguf"
    path.write_bytes(Craft().kv("general.architecture", V.STRING, "llama").build()[:cut])
    expect_error(path, field, defect)


# --- metadata ----------------------------------------------------------------------------------


def test_string_length_beyond_file(tmp_path):
    craft = valid_craft()
    craft.kvs[1].payload = u64(HUGE) + b"crafted"
    expect_error(craft_file(tmp_path, craft), "general.name", f"string length {HUGE}")


def test_key_length_beyond_file(tmp_path):
    data = bytearray(valid_craft().build())
    key_at = 24  # magic, version, tensor count, metadata count
    data[key_at : key_at + 8] = u64(HUGE)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    expect_error(path, "metadata key #0", "string length")


@pytest.mark.parametrize("etype", [V.UINT8, V.FLOAT64, V.STRING, V.ARRAY])
def test_array_count_beyond_file(tmp_path, etype):
    craft = valid_craft().kv_array("big", etype, [], count=HUGE)
    expect_error(craft_file(tmp_path, craft), "'big' array length", f"claims {HUGE}")


def test_string_array_element_length_beyond_file(tmp_path):
    payload = u32(V.STRING) + u64(2) + gstr("ok") + u64(HUGE)
    craft = valid_craft().kv("toks", V.ARRAY, payload)
    expect_error(craft_file(tmp_path, craft), "'toks'[1]", "string length")


def test_nested_arrays_within_depth_read(tmp_path):
    inner = [array(V.INT32, [1, 2]), array(V.INT32, [3])]
    craft = valid_craft().kv_array("nested", V.ARRAY, inner)
    g = read_gguf(craft_file(tmp_path, craft))
    assert [list(a) for a in g.metadata["nested"]] == [[1, 2], [3]]
    assert g.value_types["nested"] == (V.ARRAY, V.ARRAY)


def test_nested_arrays_too_deep(tmp_path):
    payload = array(V.UINT8, [1])
    for _ in range(3):
        payload = array(V.ARRAY, [payload])
    craft = valid_craft()
    craft.kv("deep", V.ARRAY, payload)
    expect_error(craft_file(tmp_path, craft), "'deep'", "nested more than 3 deep")


@pytest.mark.parametrize("type_id", [13, 99, 0xFFFFFFFF])
def test_unknown_value_type(tmp_path, type_id):
    craft = valid_craft().kv("odd", type_id, b"\0" * 8)
    expect_error(craft_file(tmp_path, craft), "'odd'", f"unknown value type {type_id}")


def test_unknown_array_element_type(tmp_path):
    craft = valid_craft().kv_array("odd", 42, [b"\0"], count=1)
    expect_error(craft_file(tmp_path, craft), "'odd'", "unknown value type 42")


def test_duplicate_key(tmp_path):
    craft = valid_craft().kv("general.name", V.STRING, "again")
    expect_error(craft_file(tmp_path, craft), "'general.name'", "duplicate key")


def test_empty_key(tmp_path):
    craft = valid_craft().kv("", V.UINT8, 1)
    expect_error(craft_file(tmp_path, craft), "metadata key #5", "empty key")


def test_invalid_utf8_key(tmp_path):
    craft = valid_craft().kv(b"bad\xff", V.UINT8, 1)
    expect_error(craft_file(tmp_path, craft), "metadata key #5", "invalid UTF-8")


def test_invalid_utf8_string_value(tmp_path):
    craft = valid_craft().kv("s", V.STRING, b"\xc3")
    expect_error(craft_file(tmp_path, craft), "'s'", "invalid UTF-8")


def test_invalid_utf8_in_string_array(tmp_path):
    craft = valid_craft().kv_array("toks", V.STRING, [b"fine", b"\xe2\x82"])
    expect_error(craft_file(tmp_path, craft), "'toks'[1]", "invalid UTF-8")


def test_utf8_split_across_array_elements_is_invalid(tmp_path):
    # The two halves of "é" are each invalid even though their concatenation is valid.
    craft = valid_craft().kv_array("toks", V.STRING, [b"\xc3", b"\xa9"])
    expect_error(craft_file(tmp_path, craft), "'toks'[0]", "invalid UTF-8")


# --- alignment ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 3, 48])
def test_alignment_not_power_of_two(tmp_path, value):
    craft = valid_craft().kv("general.alignment", V.UINT32, value)
    expect_error(craft_file(tmp_path, craft), "general.alignment", "not a power of two")


@pytest.mark.parametrize("vtype, value", [(V.FLOAT32, 32.0), (V.STRING, "32"), (V.BOOL, 1)])
def test_alignment_not_integer(tmp_path, vtype, value):
    craft = valid_craft().kv("general.alignment", vtype, value)
    expect_error(craft_file(tmp_path, craft), "general.alignment", "must be an integer")


def test_custom_alignment_reads(tmp_path):
    craft = valid_craft().kv("general.alignment", V.UINT64, 64)
    craft.alignment = 64
    g = read_gguf(craft_file(tmp_path, craft))
    assert g.alignment == 64
    assert all(t.offset % 64 == 0 for t in g.tensors.values())


def test_huge_alignment_puts_data_past_end(tmp_path):
    craft = valid_craft().kv("general.alignment", V.UINT64, 1 << 62)
    expect_error(craft_file(tmp_path, craft), "data section", "past the end")


# --- tensor infos ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_dims", [0, 5])
def test_bad_dimension_count(tmp_path, n_dims):
    craft = valid_craft()
    craft.tensors[0].n_dims = n_dims
    expect_error(craft_file(tmp_path, craft), "'a.weight'", f"{n_dims} dimensions")


@pytest.mark.parametrize("dims", [[32, 0], [0], [32, -2], [-32]])
def test_non_positive_dimension(tmp_path, dims):
    craft = valid_craft()
    craft.tensors[0].ne = dims
    expect_error(craft_file(tmp_path, craft), "'a.weight'", "must be positive")


@pytest.mark.parametrize("type_id", [4, 5, 31, 43, 1000])
def test_unknown_tensor_type(tmp_path, type_id):
    craft = valid_craft()
    craft.tensors[0].type_id = type_id
    expect_error(craft_file(tmp_path, craft), "'a.weight'", f"unknown tensor type id {type_id}")


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ4_NL, Q.TQ1_0, Q.MXFP4, Q.Q8_1, Q.Q8_K, Q.I8])
def test_unsupported_tensor_type(tmp_path, qtype):
    craft = valid_craft()
    craft.tensors[0].type_id = int(qtype)
    craft.tensors[0].ne = [256, 2]
    expect_error(
        craft_file(tmp_path, craft), "'a.weight'", f"tensor type {qtype.name} is not supported"
    )


@pytest.mark.parametrize("qtype, row", [(Q.Q4_0, 48), (Q.Q8_0, 16), (Q.Q4_K, 128), (Q.Q6_K, 300)])
def test_row_not_multiple_of_block(tmp_path, qtype, row):
    craft = valid_craft()
    craft.tensors[0].type_id = int(qtype)
    craft.tensors[0].ne = [row, 2]
    expect_error(craft_file(tmp_path, craft), "'a.weight'", f"row length {row}", "block size")


def test_duplicate_tensor_name(tmp_path):
    craft = valid_craft().tensor("a.weight", [32])
    expect_error(craft_file(tmp_path, craft), "'a.weight'", "duplicate tensor name")


def test_invalid_utf8_tensor_name(tmp_path):
    craft = valid_craft().tensor(b"c.\x80", [32])
    expect_error(craft_file(tmp_path, craft), "tensor #2 name", "invalid UTF-8")


def test_tensor_offset_unaligned(tmp_path):
    craft = valid_craft()
    craft.tensors[1].offset = 256 + 8
    expect_error(craft_file(tmp_path, craft), "'b.weight'", "not aligned to 32")


def test_tensor_past_end_of_file(tmp_path):
    craft = valid_craft()
    craft.tensors[1].data = b""  # info claims 68 bytes, none are written
    expect_error(craft_file(tmp_path, craft), "'b.weight'", "past the end of the file")


def test_tensor_offset_far_past_end(tmp_path):
    craft = valid_craft()
    craft.tensors[1].offset = HUGE
    craft.tensors[1].data = b""
    expect_error(craft_file(tmp_path, craft), "'b.weight'", "past the end of the file")


def test_huge_shape_does_not_wrap(tmp_path):
    # 2^62 x 2^62 f32 elements: int64 arithmetic would wrap; Python ints must not.
    craft = valid_craft()
    craft.tensors[0].ne = [1 << 62, 1 << 62, 1 << 62, 1 << 62]
    expect_error(craft_file(tmp_path, craft), "'a.weight'", "past the end of the file")


def test_overlapping_tensors(tmp_path):
    craft = valid_craft()
    craft.tensors[1].offset = 32  # b.weight starts inside a.weight
    expect_error(craft_file(tmp_path, craft), "'b.weight'", "overlaps tensor 'a.weight'")


def test_tensor_name_in_message_is_one_line(tmp_path):
    craft = valid_craft().tensor("evil\nname", [256], Q.IQ2_XXS)
    expect_error(craft_file(tmp_path, craft), "'evil\\nname'")


# --- positive: written by gguf.GGUFWriter, compared with gguf.GGUFReader ----------------------


def _write_reference(path: Path) -> dict:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    scalars = {
        "t.u8": (w.add_uint8, 200),
        "t.i8": (w.add_int8, -100),
        "t.u16": (w.add_uint16, 60000),
        "t.i16": (w.add_int16, -30000),
        "t.u32": (w.add_uint32, 4_000_000_000),
        "t.i32": (w.add_int32, -2_000_000_000),
        "t.u64": (w.add_uint64, 1 << 63),
        "t.i64": (w.add_int64, -(1 << 62)),
        "t.f32": (w.add_float32, 0.5),
        "t.f64": (w.add_float64, 1e-300),
        "t.bool": (w.add_bool, True),
        "t.str": (w.add_string, "héllo ✓"),
    }
    for key, (add, value) in scalars.items():
        add(key, value)
    w.add_array("t.strings", ["", "a", "ü", "<|im_end|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, -1.5])
    tensors = {
        "f32": rng.standard_normal((3, 64)).astype(np.float32),
        "f16": rng.standard_normal((2, 32)).astype(np.float16),
        "vec": rng.standard_normal(32).astype(np.float32),
    }
    for name, value in tensors.items():
        w.add_tensor(name, value)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"scalars": {k: v for k, (_, v) in scalars.items()}, "tensors": tensors, "q8": q8}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.gguf"
    written = _write_reference(path)
    return path, written


def test_reads_back_written_metadata(reference):
    path, written = reference
    g = read_gguf(path)
    assert g.architecture == "llama"
    for key, value in written["scalars"].items():
        assert g.metadata[key] == value, key
        assert type(g.metadata[key]) is type(value), key
    assert g.metadata["t.strings"] == ["", "a", "ü", "<|im_end|>"]
    assert g.value_types["t.strings"] == (V.ARRAY, V.STRING)
    assert g.value_types["t.u16"] == (V.UINT16, None)
    assert g.get("missing", 7) == 7
    ints = g.metadata["t.ints"]
    assert isinstance(ints, np.ndarray) and ints.dtype.isnative and ints.tolist() == [1, -2, 3]


def test_reads_back_written_tensors(reference):
    path, written = reference
    g = read_gguf(path)
    for name, value in written["tensors"].items():
        info = g.tensors[name]
        assert info.shape == value.shape
        assert info.n_elements == value.size
        np.testing.assert_array_equal(
            g.tensor_data(name).view(value.dtype).reshape(value.shape), value
        )
    q8 = g.tensors["q8"]
    assert (q8.qtype, q8.shape, q8.nbytes) == (Q.Q8_0, (4, 64), written["q8"].nbytes)
    np.testing.assert_array_equal(g.tensor_data("q8"), written["q8"].reshape(-1))


def test_agrees_with_gguf_reader(reference):
    path, _ = reference
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    assert ours.data_offset == theirs.data_offset
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.offset == t.data_offset
        assert info.nbytes == t.n_bytes
    assert set(theirs.fields) == set(ours.metadata) | {
        "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"
    }  # fmt: skip


def test_tensor_data_is_zero_copy_view_of_the_file(reference):
    path, _ = reference
    g = read_gguf(path)
    view = g.tensor_data("f32")
    assert view.dtype == np.uint8 and view.ndim == 1
    assert not view.flags.owndata and not view.flags.writeable
    base = view
    while not isinstance(base, np.memmap):
        base = base.base
    assert Path(base.filename) == path.resolve()
    with pytest.raises(GGUFError, match="not in the file"):
        g.tensor_data("nope")


def test_close_and_context_manager(reference):
    path, _ = reference
    with read_gguf(path) as g:
        assert isinstance(g, GGUFFile)
    with pytest.raises(GGUFError, match="closed"):
        g.tensor_data("f32")


def test_big_vocabulary_parses(tmp_path):
    # Gemma 3 has 262,144 tokens (bench/gguf_read.py times their parsing against llama.cpp's)
    tokens = [f"tok{i}" * (1 + i % 4) for i in range(262_144)]
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "gemma3")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    g = read_gguf(tmp_path / "vocab.gguf")
    assert g.metadata["tokenizer.ggml.tokens"] == tokens


# --- fuzz: any damage gives a clean GGUFError (or a still-valid file), quickly --------------


_VALID = valid_craft().kv_array("ints", V.INT32, [1, 2, 3]).kv("general.alignment", V.UINT32, 32)
_VALID_BYTES = _VALID.build()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(_VALID_BYTES) - 1), st.integers(0, 255)), max_size=6
    ),
    cut=st.integers(1, len(_VALID_BYTES)),
    word=st.none() | st.tuples(st.integers(0, len(_VALID_BYTES) - 8), st.integers(0, 2**64 - 1)),
)
def test_fuzz_damaged_files(edits, cut, word):
    data = bytearray(_VALID_BYTES)
    for pos, byte in edits:
        data[pos] = byte
    if word is not None:  # plant a random 64-bit count/length/offset somewhere
        data[word[0] : word[0] + 8] = struct.pack("<Q", word[1])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.gguf"
        path.write_bytes(bytes(data[:cut]))
        start = time.perf_counter()
        try:
            g = read_gguf(path)
        except GGUFError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e)
        else:
            for name in g.tensors:
                assert g.tensor_data(name).size == g.tensors[name].nbytes
        assert time.perf_counter() - start < 1.0
