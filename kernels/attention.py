"""Self-attention over a paged KV cache, for a flat batch of tokens from any number of sequences.

Cache layout (one layer), block_size = bs, a multiple of 16:
    k: [num_blocks, n_kv_heads, head_dim, bs]   keys as columns: the scores of 4 query rows
                                                against 16 keys are one register tile
                                                (simd.fma_tile), no horizontal sums
    v: [num_blocks, n_kv_heads, bs, v_head_dim] values as rows: 4 rows' weighted sums over 16
                                                columns likewise
stored as float16 bits, float32, or quantized to q8_0 / q4_0 groups along the head dimension
(a pair of codes and scales): see kv_store.
A sequence's block-table row maps its logical block i (positions i*bs ...) to a physical block;
slot = block * bs + offset.

`self_attention` is one call per layer: it finishes Q/K/V (per-head QK-norm, RoPE, query
scale), writes every new K/V row into its slot, then each token attends to its own sequence's
positions <= its own (causal) and, with a sliding window w, > position - w.

Work is split into items (query tile, KV heads, key chunk). A tile is up to TILE consecutive
tokens of one sequence (a prefill run), so each K/V block is read (and widened) once per tile
rather than once per token; the query heads sharing a KV head (GQA group) share it too: the
tile's (token, head) rows go eight at a time (AVX-512, else four: simd.TILE_ROWS) through every
block. (A quantized cache is always read as codes, its scales applied to whole rows of scores
and weights.) With enough tiles an item of few tokens (decoding ones) takes every KV head, and
reads each block's heads as one stretch of memory; otherwise one KV head, so that the threads
still share the work and a prefill tile's scores stay in L2. The key range is
always cut into chunks of SPLIT_BLOCKS blocks at fixed positions (block index //
SPLIT_BLOCKS). Within a chunk the softmax takes three passes (all scores, then each row's max
and weights over the whole chunk at once, then the values; keys a token does not see get weight
0, no score is set to -inf); the chunks' partial states are merged in chunk order afterwards
(flash-decoding): one long sequence still uses every thread, and a token's result is
the same bits whatever tile, batch or thread count it is computed in (a batching engine gives
each sequence the numbers it would get alone).
"""

import numpy as np
from numba import njit, prange

from .activations import exp_f32
from .hadamard import hadamard_
from .kv_store import (
    GROUP,
    codes_flat,
    codes_to_float,
    gather_scales,
    groups,
    held_shape,
    in_place,
    k_shape,
    line_hints,
    prefetch_heads,
    put,
    rotation,
    v_shape,
    widen,
)
from .norm import _norm_row
from .rope import rope_cos_sin, rope_rotate
from .simd import COL_TILES, LINE, MAX_TILE_ROWS, TILE_COLS, TILE_ROWS, fma_tile, row_max

TILE = 16
# Every chunk's softmax state costs a fixed share (buffers, a merge, the first block's misses),
# so chunks are long, and a 4000-position sequence still splits into 8 per KV head for the
# threads.
SPLIT_BLOCKS = 32
# Preparing a token (RoPE angles, norms, the cache write) is quick: below this many tokens a
# parallel region costs more than it saves.
PARALLEL_PREPARE_MIN = 4
# (tile, key chunk) pairs from which an item may take all KV heads (see _over_blocks, _plan):
# 16 decoding sequences make 16 items of 3 heads for 2 threads; 4 keep 12 of one head.
HEADS_TOGETHER_MIN = 8
PARALLEL_MERGE_MIN = 8
# The partial softmax states one pass keeps for the merge: a prompt chunk deep in a long
# context has many key chunks per tile (32 at 16k), so its tiles go in waves that fit this
# (the same bits: a token's partials do not depend on what else is in the pass).
KEPT_BYTES = 8 << 20
PREFETCH_BLOCKS = 2
# Fast-math flags for the softmax loops (the products are simd.fma_tile's, in a fixed order, and
# a row's max and sum are taken in lanes); no no-infinities flag (softmax states start at -inf).
_FAST = {"reassoc", "contract", "nnan", "nsz"}
_NEG_INF = np.float32(-np.inf)
_ZEROS = (0, 0, 0, 0, 0, 0, 0, 0)  # fma_tile offsets of one row at 0


@njit(cache=True)
def _prepare_token(qkv, t, q_norm, k_norm, eps, pos, inv_freq, neox, q_scale, kc, vc, slot, q):
    # qkv[t]: [nh*dk | nkv*dk | nkv*dv] (finished in place) -> q[t]: [nh, dk]; K/V -> cache slot
    nh, dk = q.shape[1], q.shape[2]
    nkv, bs, dv = v_shape(vc)
    row = qkv[t]
    cos = np.empty(inv_freq.shape[0], np.float32)
    sin = np.empty(inv_freq.shape[0], np.float32)
    rope_cos_sin(pos, inv_freq, cos, sin)
    tmp = np.empty(dk, np.float32)
    codes = np.empty(GROUP, np.int32)
    # a quantized cache's keys and values are stored rotated: queries turn with the keys
    k_turn, v_turn = rotation(kc, dk, False), rotation(vc, dv, True)
    for h in range(nh):
        x = row[h * dk : (h + 1) * dk]
        if q_norm.shape[0] > 0:
            _norm_row(x, q_norm, eps, tmp)
            x[:] = tmp
        rope_rotate(x, cos, sin, neox)
        if k_turn:
            hadamard_(x, k_turn)
        for c in range(dk):
            q[t, h, c] = x[c] * q_scale
    blk = slot // bs
    off = slot % bs
    k0 = nh * dk
    v0 = k0 + nkv * dk
    for h in range(nkv):
        x = row[k0 + h * dk : k0 + (h + 1) * dk]
        if k_norm.shape[0] > 0:
            _norm_row(x, k_norm, eps, tmp)
            x[:] = tmp
        rope_rotate(x, cos, sin, neox)
        if k_turn:
            hadamard_(x, k_turn)
        put(x, kc, blk, h, off, False, codes)
        v = row[v0 + h * dv : v0 + (h + 1) * dv]
        if v_turn:
            hadamard_(v, v_turn)
        put(v, vc, blk, h, off, True, codes)


# Does a token that sees the chunk's keys lo <= j < hi see any of the block at keys j0..j0+bs-1?
# The score and value passes must skip the same blocks.
@njit(cache=True, inline="always")
def _sees(lo, hi, j0, bs):
    return lo < j0 + bs and hi > j0


# Does any of the rows r0 .. r0 + count - 1 (row r: token r // G) see the block at j0?
@njit(cache=True, inline="always")
def _rows_see(lo, hi, r0, count, G, j0, bs):
    for r in range(r0, r0 + count):
        if _sees(lo[r // G], hi[r // G], j0, bs):
            return True
    return False


# -> the sum of lanes (length a power of 2) in a fixed order: halves added pairwise (in place)
@njit(cache=True, inline="always")
def _sum_lanes(lanes):
    half = lanes.shape[0] // 2
    while half > 0:
        for k in range(half):
            lanes[k] += lanes[k + half]
        half //= 2
    return lanes[0]


# simd.fma_tile over the first `count` (8, or 1 to 4: see _group_rows) of the rows whose offsets
# are given, `cols` (1 or 2) column tiles wide, the second b_next after the first in b
@njit(cache=True, inline="always")
def _tile(count, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints):
    if cols == 2:
        _tile_rows(count, 2, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints)
    else:
        _tile_rows(count, 1, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints)


# (fma_tile takes its rows and columns as literals)
@njit(cache=True, inline="always")
def _tile_rows(count, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints):
    if count == 8:
        fma_tile(8, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints)
    elif count == 4:
        fma_tile(4, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints)
    elif count == 3:
        fma_tile(3, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints)
    elif count == 2:
        fma_tile(2, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints)
    else:
        fma_tile(1, cols, add, c, c_rows, a, a_rows, b, b_at, b_next, b_step, depth, hints)


# One pass over the chunk's blocks of `cache` (K, or V where values), for KV heads h0..h1-1:
# each row group that sees a block against it (read in place where direct, else widened into
# buf first): the scores p[r, j] of row r's query (at q_at[r] in q) against key j, or the
# weighted sums out[r, :] += p[r, j] * value j. Rows r: see _attend (head_rows rows per head).
# Heads inside blocks: a block's heads are one stretch of the cache, which DRAM serves faster
# than the same bytes read a head at a time.
# A quantized cache (n_groups scale groups a head; its codes in flat) goes into buf as codes,
# unscaled: the keys pass then writes each group's partial scores to pg[g * rows + r, j]
# (scaled and summed by _attend), and the values pass reads each column group's weights from
# pg[g * rows + r, j] (p times the values' scales, from _attend).
@njit(cache=True, inline="always")
def _over_blocks(
    values, q, q_at, p, out, cache, buf, direct, h0, h1, head_rows, table, b_start, b_end, lo,
    hi, G, n_groups, flat, buf_flat, pg,
):  # fmt: skip
    nkv, rows, cols = v_shape(cache) if values else k_shape(cache)
    bs = rows if values else cols
    n_keys, dk, rows_all = p.shape[1], q.shape[2], p.shape[0]
    width = out.shape[1] if values else bs  # columns of a pass: value columns or keys
    block = rows * cols
    _, source = in_place(cache, buf)  # what fma_tile reads where direct
    # the scores the keys pass writes, or the weights the values pass reads: p, or with scale
    # groups pg (each group's partial scores; p times each value group's scales)
    pw = pg if n_groups else p
    depth = GROUP if n_groups else dk  # of a score tile: a scale group, or the head
    step = cols if direct else buf.shape[1]  # b's row stride for fma_tile
    # Keys read in place from a block of 16 are one column tile: a decoding token's 4 query rows
    # (a GQA group) would be 4 chains of fused multiply-adds, half of what keeps a core busy
    # (see simd.TILE_ROWS). Where the registers hold two column tiles, the keys of two blocks
    # share one tile instead; each lane's chain is unchanged, so the bits are the same.
    pair = not values and direct and COL_TILES == 2 and width == TILE_COLS
    # A head of a float16 block is as many lines as a keys tile has steps (two blocks of 16 keys
    # and head dim d: d lines, d steps), or a values tile (16 steps a pair of column tiles).
    spread = direct and line_hints(cache, 0, 0, 0) is not None
    head_lines = block * source.itemsize // LINE
    b = b_start
    while b < b_end:
        blocks = 2 if pair and b + 1 < b_end else 1
        j0 = (b - b_start) * bs
        blk = table[b]
        # Blocks PREFETCH_BLOCKS ahead (from the first, all of those up to it): a block is a
        # short stream at an address of its own, which the hardware prefetcher only learns
        # after several misses. Each head's hints go with that head's work: a whole block's
        # at once (256 lines at Llama-3.2-1B's shapes) queue behind each other, and decode
        # attention read the KV cache 15-30 % slower. A float16 cache read in place (`spread`)
        # spreads them further, a line a step of the tiles' loops (fma_tile's hints): a head's
        # 32 lines at once held the L1's miss buffers that the tiles' own loads needed, and
        # decode attention read the cache 25-35 % slower (Intel Xeon).
        if b == b_start:
            for ahead in range(b + 1, min(b + PREFETCH_BLOCKS, b_end)):
                prefetch_heads(cache, table[ahead], h0, h1)
        far = min(b + PREFETCH_BLOCKS, b_end - 1)  # what a spread step hints (the pair's first)
        farther = min(far + 1, b_end - 1)
        for h in range(h0, h1):
            if not spread:
                for ahead in range(b + PREFETCH_BLOCKS, min(b + PREFETCH_BLOCKS + blocks, b_end)):
                    prefetch_heads(cache, table[ahead], h, h + 1)
            far_at = (table[far] * nkv + h) * block  # head h of those blocks
            far_next = (table[farther] * nkv + h) * block if blocks == 2 else far_at
            if not direct:
                widen(cache, blk, h, buf)
                codes_to_float(cache, flat, blk, h, buf_flat, values)
            at = (blk * nkv + h) * block  # cache[blk, h, 0, 0]
            # fma_tile's b_next: the second block's keys, from the first's, or the next columns
            b_next = (table[b + 1] - blk) * nkv * block if blocks == 2 else TILE_COLS
            head_row = (h - h0) * head_rows
            r0 = 0
            while r0 < head_rows:
                count = _group_rows(head_rows - r0)
                r0 += count
                if not _rows_see(lo, hi, r0 - count, count, G, j0, blocks * bs):
                    continue
                g0 = head_row + r0 - count
                q_rows = _queries(q_at, g0)
                c = 0
                while c < width:
                    # column tiles side by side (a quantized cache's value groups hold both)
                    span = COL_TILES if width - c >= COL_TILES * TILE_COLS else blocks
                    b_at = at + c if direct else c
                    if values:
                        o_rows, w_rows = _eight(g0, width, c), _eight(g0, n_keys, j0)
                        if n_groups:
                            w_rows = _shift(w_rows, (c // GROUP) * rows_all * n_keys)
                        if direct:
                            hints = line_hints(cache, far_at + c * bs, far_at + c * bs, bs)
                            _tile(count, span, True, out, o_rows, pw, w_rows, source, b_at,
                                  b_next, step, bs, hints)  # fmt: skip
                        else:
                            _tile(count, span, True, out, o_rows, pw, w_rows, buf, b_at, b_next,
                                  step, bs, None)  # fmt: skip
                    else:
                        s_rows = _eight(g0, n_keys, j0 + c)
                        for g in range(max(n_groups, 1)):
                            g_rows = _shift(s_rows, g * rows_all * n_keys)
                            gq_rows = _shift(q_rows, g * GROUP)
                            g_at = b_at + g * GROUP * step
                            if direct:
                                hints = line_hints(cache, far_at, far_next, head_lines)
                                _tile(count, span, False, pw, g_rows, q, gq_rows, source, g_at,
                                      b_next, step, depth, hints)  # fmt: skip
                            else:
                                _tile(count, span, False, pw, g_rows, q, gq_rows, buf, g_at,
                                      b_next, step, depth, None)  # fmt: skip
                    c += span * TILE_COLS
        b += blocks


# -> the offsets of rows r0 .. r0 + 7 of a flat [rows, stride] array, plus at
@njit(cache=True, inline="always")
def _eight(r0, stride, at):
    a = r0 * stride + at
    return (a, a + stride, a + 2 * stride, a + 3 * stride, a + 4 * stride, a + 5 * stride,
            a + 6 * stride, a + 7 * stride)  # fmt: skip


# -> q_at[r0 .. r0 + 7]: the queries of rows r0 .. r0 + 7
@njit(cache=True, inline="always")
def _queries(q_at, r0):
    return (q_at[r0], q_at[r0 + 1], q_at[r0 + 2], q_at[r0 + 3], q_at[r0 + 4], q_at[r0 + 5],
            q_at[r0 + 6], q_at[r0 + 7])  # fmt: skip


@njit(cache=True, inline="always")
def _shift(rows, by):
    return (rows[0] + by, rows[1] + by, rows[2] + by, rows[3] + by, rows[4] + by, rows[5] + by,
            rows[6] + by, rows[7] + by)  # fmt: skip


# -> rows of the next row group of a head, `left` rows to go: TILE_ROWS while that many are
# left, then up to 4 (a tile of each count from 1 to 8 would double the kernel's code)
@njit(cache=True, inline="always")
def _group_rows(left):
    return TILE_ROWS if left >= TILE_ROWS else min(4, left)


@njit(cache=True, fastmath=_FAST)
def _attend(
    q, t0, t1, positions, window, h0, h1, kc, vc, table, b_start, b_end, slot, slot_step,
    m_kept, l_kept, acc_kept,
):  # fmt: skip
    # Tokens t0..t1-1 (one sequence, consecutive positions), for each KV head h in h0..h1-1
    # query heads h*G..(h+1)*G-1 of q: [n, nh, dk] against the keys of KV head h in logical
    # blocks [b_start, b_end) of block-table row `table` -> the chunk's softmax state per
    # (token in tile, head in group) at [slot + (h - h0) * slot_step, :t1 - t0] of m_kept,
    # l_kept: [slots, longest tile, G] (max score, sum of exp(score - max)) and acc_kept:
    # [slots, longest tile, G, dv] (unnormalised weighted values).
    # Three passes over the chunk: every score, then each row's max and weights, then the
    # values. A chunk is at most SPLIT_BLOCKS blocks, so its scores stay in L2.
    # Row (h - h0) * head_rows + i * G + g is token t0 + i's query head h * G + g; a head's rows
    # go through simd.fma_tile in groups (_group_rows), against 16 keys (scores) or 16 value
    # columns per pass. Each head's numbers are the same whichever heads share the call.
    G = m_kept.shape[2]
    nh, dk = q.shape[1], q.shape[2]
    _, bs, dv = v_shape(vc)
    head_rows = (t1 - t0) * G
    rows = (h1 - h0) * head_rows
    n_keys = (b_end - b_start) * bs
    first = b_start * bs  # position of the chunk's first key
    val_cols = -(-dv // TILE_COLS) * TILE_COLS
    # A head's rows in one row group (one decoding token's, or two's on AVX-512): its blocks
    # are read in place and widened in registers. A longer tile widens each block once, into
    # buffers, for all of its groups (V's zero-padded to whole tiles). The arithmetic is the
    # same either way, so a token's bits do not depend on it. A quantized cache is read as
    # codes (q8_0's in place, q4_0's through the buffers), its scales applied to whole rows of
    # scores and weights (see _over_blocks).
    one_group = _group_rows(head_rows) == head_rows
    direct_k = one_group and in_place(kc, q)[0]
    direct_v = one_group and dv == val_cols and in_place(vc, q)[0]
    kf = np.empty((0 if direct_k else dk, bs), np.float32)
    vf = np.zeros((0 if direct_v else bs, val_cols), np.float32)
    p = np.empty((rows, n_keys), np.float32)
    k_groups, v_groups = groups(kc, False), groups(vc, True)
    pg = np.empty((max(k_groups, v_groups) * rows, n_keys), np.float32)
    k_scales = np.empty((h1 - h0, k_groups, n_keys), np.float32)
    gather_scales(kc, table, b_start, b_end, h0, h1, k_scales, False)
    out = np.zeros((rows, val_cols), np.float32)
    q_at = np.empty(rows + MAX_TILE_ROWS, np.int64)  # flat offset of each row's query in q
    for r in range(rows):
        h, hr = h0 + r // head_rows, r % head_rows
        q_at[r] = ((t0 + hr // G) * nh + h * G + hr % G) * dk
    q_at[rows:] = q_at[0]  # offsets past the last row: passed, never read
    # token t0 + i sees the chunk's keys lo[i] <= j < hi[i] (causal, inside its window)
    lo = np.empty(t1 - t0, np.int64)
    hi = np.empty(t1 - t0, np.int64)
    for i in range(t1 - t0):
        hi[i] = min(positions[t0 + i] + 1 - first, n_keys)
        lo[i] = max(positions[t0 + i] - window + 1 - first, 0) if window > 0 else 0
    _over_blocks(
        False, q, q_at, p, out, kc, kf, direct_k, h0, h1, head_rows, table, b_start, b_end, lo,
        hi, G, k_groups, codes_flat(kc), kf.reshape(-1), pg,
    )  # fmt: skip
    if k_groups:  # score = sum over groups of the key's group scale times the partial score
        for r in range(rows):
            sc, row = k_scales[r // head_rows], p[r]
            for j in range(n_keys):
                row[j] = sc[0, j] * pg[r, j]
            for g in range(1, k_groups):
                for j in range(n_keys):
                    row[j] += sc[g, j] * pg[g * rows + r, j]
    lanes = np.empty(TILE_COLS, np.float32)
    ones = np.ones(n_keys // TILE_COLS, np.float32)
    for r in range(rows):
        at = slot + (r // head_rows) * slot_step
        i, g = (r % head_rows) // G, r % G
        a, e = lo[i], hi[i]
        row = p[r]
        m_kept[at, i, g] = _NEG_INF
        l_kept[at, i, g] = 0.0
        if e <= a:
            row[:] = 0.0  # no key of this chunk is visible: the state stays empty
            continue
        # A max does not round, so its order changes nothing (but a tie of -0 and +0, alike to
        # exp): one reduction over the visible keys, which vectorizes.
        mx = row_max(p, r * n_keys + a, e - a)
        seen = row[a:e]  # (indexed from 0: a loop from a would check for negative indices)
        row[:a] = 0.0
        for j in range(seen.shape[0]):
            seen[j] = exp_f32(seen[j] - mx)
        row[e:] = 0.0
        # Summed in lanes over the chunk in order (fma_tile times ones: each lane one chain of
        # exact products), then the lanes in a fixed order: how many blocks the chunk has
        # depends on the tile, and a token's sum must not (they only add zeros to its lanes; a
        # vectorized loop's order would depend on its length).
        fma_tile(1, 1, False, lanes, _ZEROS, ones, _ZEROS, p, r * n_keys, TILE_COLS, TILE_COLS,
                 n_keys // TILE_COLS, None)  # fmt: skip
        total = _sum_lanes(lanes)
        m_kept[at, i, g] = mx
        l_kept[at, i, g] = total
    if v_groups:  # each value group's weights: p times the key's scale of that group
        v_scales = np.empty((h1 - h0, v_groups, n_keys), np.float32)
        gather_scales(vc, table, b_start, b_end, h0, h1, v_scales, True)
        for r in range(rows):
            sc, row = v_scales[r // head_rows], p[r]
            for g in range(v_groups):
                for j in range(n_keys):
                    pg[g * rows + r, j] = row[j] * sc[g, j]
    _over_blocks(
        True, q, q_at, p, out, vc, vf, direct_v, h0, h1, head_rows, table, b_start, b_end, lo,
        hi, G, v_groups, codes_flat(vc), vf.reshape(-1), pg,
    )  # fmt: skip
    for r in range(rows):
        at = slot + (r // head_rows) * slot_step
        for c in range(dv):
            acc_kept[at, (r % head_rows) // G, r % G, c] = out[r, c]


@njit(cache=True, fastmath=_FAST)
def _merge(t, h, tiles, first_slot, n_chunks, m, l, acc, v_turn, out):
    # Combine the chunk states of (token t, KV head h) into out[t]'s heads of that group; the
    # values were stored rotated by v_turn (kv_store.rotation): turned back (H is its inverse).
    G, dv = m.shape[2], acc.shape[3]
    i = np.searchsorted(tiles[:, 0], t, side="right") - 1
    r = t - tiles[i, 0]
    base = first_slot[i] + h * n_chunks[i]
    for g in range(G):
        mx = _NEG_INF
        for c in range(n_chunks[i]):
            mx = max(mx, m[base + c, r, g])
        total = np.float32(0.0)
        o = out[t, (h * G + g) * dv : (h * G + g + 1) * dv]
        o[:] = 0.0
        for c in range(n_chunks[i]):
            if m[base + c, r, g] == _NEG_INF:
                continue  # this chunk held no key visible to token t
            w = exp_f32(m[base + c, r, g] - mx)
            total += l[base + c, r, g] * w
            a = acc[base + c, r, g]
            for j in range(dv):
                o[j] += a[j] * w
        inv = np.float32(1.0) / total
        for j in range(dv):
            o[j] *= inv
        if v_turn:
            hadamard_(o, v_turn)


@njit(cache=True, fastmath=_FAST)
def _item(
    item, tiles, n_chunks, first_slot, q, positions, window, kc, vc, block_tables, seq_rows,
    m_kept, l_kept, acc_kept,
):  # fmt: skip
    # One (tile, KV heads, key chunk): its partial softmax states, kept at each (tile, head,
    # chunk)'s slot for _merge.
    # (Its own function: array expressions in a parallel=True body become parallel regions.)
    i, h0, h1, c = item[0], item[1], item[2], item[3]
    t0, t1 = tiles[i, 0], tiles[i, 1]
    bs = v_shape(vc)[1]
    chunk = tiles[i, 2] // SPLIT_BLOCKS + c
    b_start = max(tiles[i, 2], chunk * SPLIT_BLOCKS)
    b_end = min((chunk + 1) * SPLIT_BLOCKS, positions[t1 - 1] // bs + 1)
    slot = first_slot[i] + h0 * n_chunks[i] + c
    _attend(
        q, t0, t1, positions, window, h0, h1, kc, vc, block_tables[seq_rows[t0]], b_start,
        b_end, slot, n_chunks[i], m_kept, l_kept, acc_kept,
    )  # fmt: skip


@njit(cache=True)
def _tile_starts(seq_rows, positions):
    # -> the first token of each tile: up to TILE consecutive positions of one sequence
    starts = [0]
    for t in range(1, positions.shape[0]):
        if (
            seq_rows[t] != seq_rows[t - 1]
            or positions[t] != positions[t - 1] + 1
            or t - starts[-1] == TILE
        ):
            starts.append(t)
    return starts


@njit(cache=True)
def _first_block(position, window, bs):
    # the first block a query at `position` reads
    return max(position - window + 1, 0) // bs if window > 0 else 0


@njit(cache=True)
def _n_chunks(first_block, last_position, bs):
    # key chunks of a tile reading blocks first_block .. last_position's
    return last_position // bs // SPLIT_BLOCKS - first_block // SPLIT_BLOCKS + 1


@njit(cache=True)
def _plan(seq_rows, positions, window, bs, nkv):
    # -> tiles: int64[n_tiles, 3] (t0, t1, first block), chunks per tile, each tile's first
    # slot (slot of (tile i, head h, chunk c): first_slot[i] + h * chunks + c), and item ->
    # (tile, first head, end head, chunk) in an order that interleaves long and short items so
    # prange's contiguous halves get similar work. An item takes every KV head once there are
    # HEADS_TOGETHER_MIN (tile, chunk) pairs (fewer would leave threads idle) and its tile's
    # tokens times KV heads are at most TILE, else one: its scores then never outgrow those of
    # one head over a whole tile, which stay in L2 (see _attend).
    n = positions.shape[0]
    starts = _tile_starts(seq_rows, positions)
    n_tiles = len(starts)
    tiles = np.empty((n_tiles, 3), np.int64)
    for i in range(n_tiles):
        t0 = starts[i]
        t1 = starts[i + 1] if i + 1 < n_tiles else n
        tiles[i, 0] = t0
        tiles[i, 1] = t1
        tiles[i, 2] = _first_block(positions[t0], window, bs)
    n_chunks = np.empty(n_tiles, np.int64)
    for i in range(n_tiles):
        n_chunks[i] = _n_chunks(tiles[i, 2], positions[tiles[i, 1] - 1], bs)
    together = n_chunks.sum() >= HEADS_TOGETHER_MIN
    heads = np.ones(n_tiles, np.int64)
    for i in range(n_tiles):
        if together and (tiles[i, 1] - tiles[i, 0]) * nkv <= TILE:
            heads[i] = nkv
    n_items = (n_chunks * (nkv // heads)).sum()
    items = np.empty((n_items, 4), np.int64)
    k = 0
    for i in range(n_tiles):
        for h in range(0, nkv, heads[i]):
            for c in range(n_chunks[i]):
                items[k, 0] = i
                items[k, 1] = h
                items[k, 2] = h + heads[i]
                items[k, 3] = c
                k += 1
    order = np.empty(n_items, np.int64)
    for k in range(n_items):
        order[k] = k // 2 if k % 2 == 0 else n_items - 1 - k // 2
    first_slot = np.zeros(n_tiles + 1, np.int64)
    for i in range(n_tiles):
        first_slot[i + 1] = first_slot[i] + n_chunks[i] * nkv
    return tiles, n_chunks, first_slot, items[order]


@njit(parallel=True, cache=True)
def _self_attention(
    qkv,
    q_norm,
    k_norm,
    eps,
    inv_freq,
    neox,
    q_scale,
    window,
    kc,
    vc,
    block_tables,
    seq_rows,
    positions,
    slots,
    nh,
    kept_bytes,
):
    n = qkv.shape[0]
    nkv, dk, bs = k_shape(kc)
    dv = v_shape(vc)[2]
    G = nh // nkv
    q = np.empty((n, nh, dk), np.float32)
    out = np.empty((n, nh * dv), np.float32)
    if n < PARALLEL_PREPARE_MIN:
        for t in range(n):
            _prepare_token(
                qkv, t, q_norm, k_norm, eps, positions[t], inv_freq, neox, q_scale, kc, vc,
                slots[t], q,
            )  # fmt: skip
    else:
        for t in prange(n):
            _prepare_token(
                qkv, t, q_norm, k_norm, eps, positions[t], inv_freq, neox, q_scale, kc, vc,
                slots[t], q,
            )  # fmt: skip
    # tiles go in waves whose partial softmax states fit kept_bytes (at least one tile a wave)
    starts = _tile_starts(seq_rows, positions)
    n_tiles = len(starts)
    i = 0
    while i < n_tiles:
        j, kept = i, 0
        while j < n_tiles:
            t1 = starts[j + 1] if j + 1 < n_tiles else n
            first = _first_block(positions[starts[j]], window, bs)
            chunks = _n_chunks(first, positions[t1 - 1], bs)
            size = chunks * nkv * (t1 - starts[j]) * G * (dv + 2) * 4
            if j > i and kept + size > kept_bytes:
                break
            kept += size
            j += 1
        a, b = starts[i], starts[j] if j < n_tiles else n
        _attend_tiles(q[a:b], out[a:b], seq_rows[a:b], positions[a:b], window, kc, vc,
                      block_tables, bs, nkv, G, dv)  # fmt: skip
        i = j
    return out


@njit(parallel=True, cache=True)
def _attend_tiles(q, out, seq_rows, positions, window, kc, vc, block_tables, bs, nkv, G, dv):
    # Attention of the prepared queries q: [n, nh, dk] of whole tiles -> out: [n, nh * dv].
    n = positions.shape[0]
    tiles, n_chunks, first_slot, items = _plan(seq_rows, positions, window, bs, nkv)
    n_items = items.shape[0]
    longest = 1  # tokens in the longest tile: 1 in a step of decoding tokens only
    for i in range(tiles.shape[0]):
        longest = max(longest, tiles[i, 1] - tiles[i, 0])
    n_slots = first_slot[tiles.shape[0]]
    m_kept = np.empty((n_slots, longest, G), np.float32)
    l_kept = np.empty((n_slots, longest, G), np.float32)
    acc_kept = np.empty((n_slots, longest, G, dv), np.float32)
    for k in prange(n_items):
        _item(
            items[k], tiles, n_chunks, first_slot, q, positions, window, kc, vc, block_tables,
            seq_rows, m_kept, l_kept, acc_kept,
        )  # fmt: skip
    v_turn = rotation(vc, dv, True)
    # Decode-sized loops run serially: a parallel region costs more than their work.
    if n * nkv < PARALLEL_MERGE_MIN:
        for th in range(n * nkv):
            _merge(th // nkv, th % nkv, tiles, first_slot, n_chunks, m_kept, l_kept, acc_kept,
                   v_turn, out)  # fmt: skip
    else:
        for th in prange(n * nkv):
            _merge(th // nkv, th % nkv, tiles, first_slot, n_chunks, m_kept, l_kept, acc_kept,
                   v_turn, out)  # fmt: skip


def self_attention(
    qkv: np.ndarray,
    q_norm: np.ndarray,
    k_norm: np.ndarray,
    eps: float,
    inv_freq: np.ndarray,
    neox: bool,
    q_scale: float,
    window: int,
    k_cache: np.ndarray | tuple[np.ndarray, np.ndarray],
    v_cache: np.ndarray | tuple[np.ndarray, np.ndarray],
    block_tables: np.ndarray,
    seq_rows: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    n_heads: int,
    kept_bytes: int = KEPT_BYTES,
) -> np.ndarray:
    """One layer's attention for a flat batch of n tokens; writes their K/V into the cache.

    qkv: float32[n, (n_heads + nkv) * dk + nkv * dv] (Q | K | V heads before QK-norm and RoPE;
    used as scratch); q_norm, k_norm: float32[dk] or [0] (per-head RMS norm, eps);
    inv_freq: float64[rope_dims / 2]; q_scale: multiplies Q after RoPE (the 1/sqrt(d) scale);
    window: sliding window in tokens (0: none);
    k_cache: [num_blocks, nkv, dk, block_size], v_cache: [num_blocks, nkv, block_size, dv]
    (uint16 float16 bits, or float32), or either one a quantized (codes, scales) pair (see
    kv_store); block_tables: int32[seqs, max_blocks];
    seq_rows: int32[n] (row of block_tables per token); positions: int32[n]; slots: int64[n];
    kept_bytes: most bytes of partial softmax states one wave of tiles keeps (see KEPT_BYTES)
    -> float32[n, n_heads * dv]
    """
    k_held, v_held = held_shape(k_cache, 2), held_shape(v_cache, 3)
    block_size = v_held[2]
    if block_size % TILE_COLS:
        raise ValueError(f"KV block size must be a multiple of {TILE_COLS}, got {block_size}")
    if k_held[:2] != v_held[:2] or k_held[3] != block_size:
        raise ValueError(
            f"K cache of shape {k_held} does not match V cache {v_held} (want"
            " K [blocks, kv heads, head_dim, block_size], V [blocks, kv heads, block_size, v dim])"
        )
    arrays = [a for c in (k_cache, v_cache) for a in (c if isinstance(c, tuple) else (c,))]
    if not all(a.flags.c_contiguous for a in arrays):
        raise ValueError("the KV cache must be C-contiguous (blocks are read by flat offset)")
    return _self_attention(
        qkv,
        q_norm,
        k_norm,
        np.float32(eps),
        inv_freq,
        neox,
        np.float32(q_scale),
        window,
        k_cache,
        v_cache,
        block_tables,
        seq_rows,
        positions,
        slots,
        n_heads,
        kept_bytes,
    )
