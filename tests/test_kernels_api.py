"""The kernels package contract: registry, QuantWeight, argument checks, threads, act_quant."""

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from threadpoolctl import threadpool_info

from edgeinfer import EdgeInferError, kernels
from edgeinfer.kernels import registry
from edgeinfer.kernels.act_quant import quantize_rows

T = GGMLQuantizationType
LEGACY = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def q8_0_bytes(rows, cols, rng):
    raw = rng.integers(0, 256, size=(rows * cols // 32, 34), dtype=np.uint8)
    raw[:, :2] = (rng.random((raw.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def test_registry_has_every_legacy_type_with_gguf_sizes():
    supported = kernels.supported_types()
    for qtype in LEGACY:
        assert qtype in supported
        unit = kernels.get_unit(qtype)
        assert (unit.block_size, unit.type_size) == GGML_QUANT_SIZES[qtype]


def test_qtype_accepted_as_enum_name_or_int():
    data = q8_0_bytes(2, 64, np.random.default_rng(0))
    a = kernels.dequantize(data, T.Q8_0, (2, 64))
    assert np.array_equal(a, kernels.dequantize(data, "q8_0", (2, 64)))
    assert np.array_equal(a, kernels.dequantize(data, int(T.Q8_0), [2, 64]))


def test_dequantize_keeps_any_rows_first_shape():
    data = q8_0_bytes(6, 64, np.random.default_rng(1))
    want = gguf_dequantize(data, T.Q8_0)
    assert np.array_equal(kernels.dequantize(data, T.Q8_0, (384,)), want)
    assert np.array_equal(kernels.dequantize(data, T.Q8_0, (2, 3, 64)), want.reshape(2, 3, 64))


def test_unsupported_type_is_a_user_facing_error():
    with pytest.raises(kernels.UnsupportedTypeError) as e:
        kernels.get_unit(T.IQ2_XXS)
    assert isinstance(e.value, EdgeInferError) and "IQ2_XXS" in str(e.value)
    with pytest.raises(ValueError):
        kernels.get_unit("Q9_9")


def test_bad_sizes_are_rejected():
    data = q8_0_bytes(2, 64, np.random.default_rng(2))
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.dequantize(data, T.Q8_0, (4, 33))
    with pytest.raises(ValueError, match="bytes"):
        kernels.dequantize(data[:-1], T.Q8_0, (2, 64))
    with pytest.raises(ValueError, match="2-D"):
        kernels.QuantWeight.from_raw(data, T.Q8_0, (128,))


def test_quant_type_checks_sizes_against_gguf():
    unit = kernels.get_unit(T.Q4_0)
    with pytest.raises(ValueError):
        registry.QuantType(T.Q4_0, 32, 20, unit.dequantize_rows, unit.matmul_small)


def test_quant_weight_stays_on_the_file_bytes():
    data = q8_0_bytes(48, 256, np.random.default_rng(3))
    w = kernels.QuantWeight.from_raw(data, T.Q8_0, (48, 256))
    assert w.shape == (48, 256) and w.qtype == T.Q8_0
    assert w.nbytes == data.nbytes and w.extra_nbytes <= 16  # a part table, not a copy
    assert np.shares_memory(w.raw, data)
    for qtype in LEGACY:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = np.zeros(16 * 256 // block * size, np.uint8)
        assert kernels.QuantWeight.from_raw(raw, qtype, (16, 256)).extra_nbytes <= raw.nbytes // 10


SCALES = {T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q6_K: (208,)}


def _random_weight(rng, qtype, rows, cols):
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), np.uint8)
    for off in SCALES[qtype]:  # sane float16 scales (random bits would give inf and NaN)
        h = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, off : off + 2] = h.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", list(SCALES), ids=lambda t: t.name)
def test_stacked_weights_in_one_buffer_give_each_parts_own_rows(qtype):
    """Q, K and V in one launch: weights of one type viewing one buffer (as a model file's
    do), not back to back, give bit for bit the rows each gives on its own."""
    block, size = GGML_QUANT_SIZES[qtype]
    cols, outs = 512, (40, 12, 12)
    row_bytes = cols // block * size
    rng = np.random.default_rng(int(qtype))
    buf = _random_weight(rng, qtype, sum(o + 1 for o in outs), cols)
    buf.flags.writeable = False
    parts, at = [], row_bytes  # a row's worth of other bytes before and between the parts
    for o in outs:
        parts.append(kernels.QuantWeight.from_raw(buf[at : at + o * row_bytes], qtype, (o, cols)))
        at += (o + 1) * row_bytes
    packed = kernels.stack(parts)
    assert packed is not None
    for n in range(1, parts[0].unit.small_n_max + 1):
        x = rng.standard_normal((n, cols), dtype=np.float32)
        want = np.concatenate([kernels.matmul(x, p) for p in parts], axis=1)
        got = kernels.bind_stacked(parts, packed)(x)
        assert got.shape == (n, sum(outs)) and np.isfinite(got).all()
        assert np.array_equal(got, want)
    other = kernels.QuantWeight.from_raw(np.zeros(8 * cols, np.float32), T.F32, (8, cols))
    apart = kernels.QuantWeight.from_raw(buf[: row_bytes * 12].copy(), qtype, (12, cols))
    assert kernels.stack([parts[0], other]) is None
    assert kernels.stack([parts[0], apart]) is None  # not in one buffer
    # the row-wise path: one launch over the parts in one buffer, part by part otherwise
    for group in (parts, [parts[0], other], [parts[0], apart]):
        for n in (1, 7, 70):
            x = rng.standard_normal((n, cols), dtype=np.float32)
            want = np.concatenate([kernels.matmul(x, p, row_wise=True) for p in group], axis=1)
            got = kernels.bind_row_wise(group)(x)
            assert got.shape == want.shape and np.isfinite(got).all()
            assert np.array_equal(got, want)


def test_parts_of_two_types_take_the_fused_kernels_one_launch_per_type():
    """Q and K in Q4_K, V in Q6_K (a Q4_K_M file's layers): a decode-sized call gives each
    part's own fused-kernel rows, up to the smaller small_n_max, and a row-wise call each part's
    own row-wise rows; a part without a fused kernel leaves no small-n path."""
    rng = np.random.default_rng(5)
    cols, outs = 512, (24, 8)
    row_bytes = cols // 256 * GGML_QUANT_SIZES[T.Q4_K][1]
    buf = _random_weight(rng, T.Q4_K, sum(outs), cols)
    buf.flags.writeable = False
    q = kernels.QuantWeight.from_raw(buf[: outs[0] * row_bytes], T.Q4_K, (outs[0], cols))
    k = kernels.QuantWeight.from_raw(buf[outs[0] * row_bytes :], T.Q4_K, (outs[1], cols))
    v = kernels.QuantWeight.from_raw(_random_weight(rng, T.Q6_K, 8, cols), T.Q6_K, (8, cols))
    call, n_max = kernels.bind_small([q, k, v])
    assert n_max == min(q.unit.small_n_max, v.unit.small_n_max)
    for n in range(1, n_max + 1):
        x = rng.standard_normal((n, cols), dtype=np.float32)
        want = np.concatenate([kernels.matmul(x, p) for p in (q, k, v)], axis=1)
        got = call(x)
        assert got.shape == (n, 40) and np.isfinite(got).all()
        assert np.array_equal(got, want)
    # the row-wise paths: Q and K in one launch, V in another, each part's own rows
    for int8 in (False, True):
        for n in (1, 7, 70):
            x = rng.standard_normal((n, cols), dtype=np.float32)
            parts = [kernels.bind_row_wise([p], int8=int8)(x) for p in (q, k, v)]
            assert np.array_equal(kernels.bind_row_wise([q, k, v], int8=int8)(x), np.hstack(parts))
    half = np.zeros(8 * cols, np.float16).view(np.uint8)
    other = kernels.QuantWeight.from_raw(half, T.F16, (8, cols))
    assert other.unit.matmul_small is None and kernels.bind_small([q, other]) is None


def test_float32_weights_in_one_buffer_share_one_row_wise_launch():
    # F32's small-n kernel is BLAS on its own layout (no stack), but its row-tile kernel reads
    # the file's bytes like the quantized units' do
    from edgeinfer.kernels.weight import stack_rows

    rng = np.random.default_rng(11)
    cols, outs = 96, (20, 9)
    buf = rng.standard_normal(sum(outs) * cols + cols).astype(np.float32).view(np.uint8)
    buf.flags.writeable = False
    row_bytes = 4 * cols
    parts = [
        kernels.QuantWeight.from_raw(buf[row_bytes : row_bytes * 21], T.F32, (20, cols)),
        kernels.QuantWeight.from_raw(buf[row_bytes * 21 :], T.F32, (9, cols)),
    ]
    assert kernels.stack(parts) is None and stack_rows(parts) is not None
    x = rng.standard_normal((5, cols), dtype=np.float32)
    wf = buf[row_bytes:].view(np.float32).reshape(29, cols).astype(np.float64)
    got = kernels.bind_row_wise(parts)(x)
    assert np.allclose(got, x @ wf.T, rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[:, 20:], kernels.matmul(x, parts[1], row_wise=True))


def test_row_wise_blocks_of_a_wide_input_give_the_same_bits():
    # the row-wise path cuts a wide x into blocks of rows that stay in cache (ROW_WISE_X_BYTES):
    # rows across a block boundary must come out as they would alone
    from edgeinfer.kernels.matmul import ROW_WISE_X_BYTES

    rng = np.random.default_rng(8)
    cols = 8192
    step = ROW_WISE_X_BYTES // (4 * cols)
    wf = rng.standard_normal((24, cols)).astype(np.float16)
    w = kernels.QuantWeight.from_raw(wf.view(np.uint8).reshape(-1), T.F16, (24, cols))
    x = rng.standard_normal((2 * step + 5, cols)).astype(np.float32)
    got = kernels.matmul(x, w, row_wise=True)
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    assert ((got - ref) ** 2).sum() / (ref**2).sum() <= 1e-10
    for lo, hi in ((0, 1), (step - 1, step + 2), (2 * step, 2 * step + 5)):
        assert np.array_equal(kernels.matmul(x[lo:hi], w, row_wise=True), got[lo:hi])


def test_matmul_checks_and_converts_x():
    rng = np.random.default_rng(4)
    w = kernels.QuantWeight.from_raw(q8_0_bytes(10, 64, rng), T.Q8_0, (10, 64))
    with pytest.raises(ValueError, match="does not match"):
        kernels.matmul(np.zeros((1, 32), np.float32), w)
    x = rng.standard_normal((64, 3)).T  # float64, not contiguous
    assert np.allclose(kernels.matmul(x, w), kernels.matmul(np.ascontiguousarray(x, np.float32), w))


def test_embedding_rejects_out_of_range_ids():
    w = kernels.QuantWeight.from_raw(q8_0_bytes(10, 64, np.random.default_rng(5)), T.Q8_0, (10, 64))
    with pytest.raises(IndexError):
        kernels.embedding(w, [0, 10])
    with pytest.raises(IndexError):
        kernels.embedding(w, [-1])


def test_threads_knob_reaches_numba_and_blas_stays_single_threaded():
    before = kernels.get_threads()
    try:
        assert kernels.set_threads(1) == 1 and kernels.get_threads() == 1
        data = q8_0_bytes(8, 64, np.random.default_rng(6))
        w = kernels.QuantWeight.from_raw(data, T.Q8_0, (8, 64))
        kernels.matmul(np.ones((1, 64), np.float32), w)
        assert numba.get_num_threads() == 1
        # BLAS-backed work is split over the knob's threads by the kernels themselves
        assert all(p["num_threads"] == 1 for p in threadpool_info() if p["user_api"] == "blas")
        with pytest.raises(ValueError):
            kernels.set_threads(0)
        assert kernels.set_threads(None) >= 1
    finally:
        kernels.set_threads(before)


def test_run_split_covers_every_item_once():
    seen = np.zeros(1001, np.int64)

    def mark(lo, hi):
        seen[lo:hi] += 1

    before = kernels.get_threads()
    try:
        for n in (1, 2):
            kernels.set_threads(n)
            seen[:] = 0
            kernels.threads.run_split(1001, mark, min_items=10)
            assert np.all(seen == 1)
            assert numba.get_num_threads() == kernels.get_threads()
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize("q_type", [np.int8, np.int16])
@pytest.mark.parametrize("block,sum_group", [(32, 32), (32, 0), (256, 16), (256, 32)])
def test_act_quant_round_trip_and_sums(block, sum_group, q_type):
    rng = np.random.default_rng(block + sum_group)
    x = rng.standard_normal((3, 4 * block)).astype(np.float32)
    x[1, :block] = 0.0  # an all-zero block gets scale 0, not NaN
    q, d, sums = quantize_rows(x, block, sum_group, q_type)
    assert q.dtype == q_type and d.shape == (3, 4) and d[1, 0] == 0.0
    back = q.reshape(3, 4, block) * d[:, :, None]
    assert np.all(np.abs(back.reshape(3, -1) - x) <= np.repeat(d, block, axis=1) / 2 + 1e-7)
    assert np.abs(q).max() == 127
    if sum_group:
        want = q.astype(np.int32).reshape(3, -1, sum_group).sum(axis=2)
        assert np.array_equal(sums, want)
    else:
        assert sums.shape == (3, 0)
    # a block's scale is its largest magnitude / 127, of either sign, a NaN passed over
    x[0, 5], x[2, block + 3], x[2, 2 * block] = -1e3, np.nan, -0.0
    d = quantize_rows(x, block, sum_group, q_type)[1]
    want = np.nanmax(np.abs(x).reshape(3, 4, block), axis=2) / np.float32(127)
    assert d.dtype == want.dtype and np.array_equal(d, want)


def test_linear_fast_path_matches_the_general_path():
    # Decode-sized calls skip kernels.matmul's checks; an input the fused kernel cannot take as
    # it is (strided, float64) must still get the same numbers through the general path.
    from edgeinfer.models.base import Linear

    rng = np.random.default_rng(6)
    cols, outs = 256, (24, 8, 8)
    buf = q8_0_bytes(sum(outs), cols, rng)
    buf.flags.writeable = False
    row_bytes = cols // 32 * 34
    ends = np.cumsum((0, *outs)) * row_bytes
    parts = [
        kernels.QuantWeight.from_raw(buf[a:b], T.Q8_0, (o, cols))
        for a, b, o in zip(ends[:-1], ends[1:], outs, strict=True)
    ]
    for linear in (Linear(parts), Linear(parts[:1])):
        for n in (1, 3):
            x = rng.standard_normal((n, 2 * cols)).astype(np.float32)
            want = np.concatenate([kernels.matmul(x[:, ::2], p) for p in linear.parts], axis=1)
            assert np.array_equal(linear(np.ascontiguousarray(x[:, ::2])), want)
            assert np.array_equal(linear(x[:, ::2]), want)
            assert np.array_equal(linear(x[:, ::2].astype(np.float64)), want)
