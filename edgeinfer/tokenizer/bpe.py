"""Byte-level BPE (`tokenizer.ggml.model = gpt2`), merge for merge as llama.cpp does it.

Each word from the pre-tokenizer is turned into GPT-2's printable byte alphabet, split into
characters, and the adjacent pair of lowest merge rank (leftmost on ties) is merged until none
is left. Words repeat a lot in real text, so finished words are cached: the merge loop runs
in Python only for words not seen before.
"""

from __future__ import annotations

import heapq

from edgeinfer.tokenizer.cache import cached
from edgeinfer.tokenizer.vocab import Vocab


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the
    others take the code points from 256 upwards, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


BYTE_CHARS = _gpt2_byte_chars()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_CHARS)}
# str.translate table: a word decoded as Latin-1 (one char per UTF-8 byte) -> GPT-2 alphabet.
_TO_BYTE_CHARS = {b: c for b, c in enumerate(BYTE_CHARS)}
_CACHE_LIMIT = 1 << 17


def _tables(vocab: Vocab) -> tuple[dict[str, int], dict, list[str]]:
    """-> (byte character -> symbol, merges, extra symbols). Symbols are numbered: a token's id,
    or an id past the vocabulary for a string that only a merge rule or the byte alphabet
    names (extra[id - vocabulary size]). llama.cpp merges strings; ids give the same result (a
    symbol changed iff its id did) without hashing strings in the loop. merges: (left id, right
    id) -> (rank, merged id); the first rule for a pair wins, and a rule without its separating
    space never applies, as in llama.cpp."""
    extra: list[str] = []
    n_vocab = len(vocab.tokens)
    ids = dict(vocab.token_to_id)

    def symbol(text: str) -> int:
        sid = ids.get(text)
        if sid is None:
            sid = ids[text] = n_vocab + len(extra)
            extra.append(text)
        return sid

    byte_char_ids = {c: symbol(c) for c in BYTE_CHARS}
    merges: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, rule in enumerate(vocab.merges):
        cut = rule.find(" ", 1)
        if cut >= 0:
            left, right = rule[:cut], rule[cut + 1 :]
            pair = (symbol(left), symbol(right))
            if pair not in merges:
                merges[pair] = (rank, symbol(left + right))
    return byte_char_ids, merges, extra


def _are_tables(value) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 3
        and isinstance(value[0], dict)
        and isinstance(value[1], dict)
        and isinstance(value[2], list)
    )


class BPEModel:
    def __init__(self, vocab: Vocab):
        self._token_to_id = vocab.token_to_id
        self._pre = vocab.pre
        self._byte_char_ids, self._merges, self._extra = cached(
            vocab.path, "bpe", lambda: _tables(vocab), _are_tables
        )
        self._n_vocab = len(vocab.tokens)
        self._cache: dict[str, list[int]] = {}

    def clear_cache(self) -> None:
        self._cache.clear()

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of raw text (no special tokens in it) to `out`."""
        cache = self._cache
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        for word in self._pre.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = cache[word] = self._encode_word(word)
            out += ids

    def _encode_word(self, word: str) -> list[int]:
        chars = word.encode().decode("latin-1").translate(_TO_BYTE_CHARS)
        if self._pre.ignore_merges and chars in self._token_to_id:
            return [self._token_to_id[chars]]
        ids = []
        n_vocab = self._n_vocab
        for sid in self._merge([self._byte_char_ids[c] for c in chars]):
            if sid < n_vocab:
                ids.append(sid)
                continue
            # Not a token: llama.cpp looks up each UTF-8 byte of the piece as a one-byte token
            # text, which only ASCII bytes can be, and drops the rest.
            for b in self._extra[sid - n_vocab].encode():
                tid = self._token_to_id.get(chr(b)) if b < 0x80 else None
                if tid is not None:
                    ids.append(tid)
        return ids

    def _merge(self, syms: list[int]) -> list[int]:
        n = len(syms)
        if n < 2:
            return syms
        merges = self._merges
        # (rank, left, right, left id, right id, merged id): popped lowest rank first, then
        # leftmost, as llama.cpp's queue orders them.
        heap = []
        for i in range(n - 1):
            m = merges.get((syms[i], syms[i + 1]))
            if m is not None:
                heap.append((m[0], i, i + 1, syms[i], syms[i + 1], m[1]))
        if not heap:
            return syms
        heapq.heapify(heap)
        nxt = [*range(1, n), -1]
        prv = [*range(-1, n - 1)]
        alive = [True] * n
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, right, a, b, merged = pop(heap)
            # Skip pairs a previous merge made stale (llama.cpp compares the texts).
            if not (alive[left] and alive[right] and syms[left] == a and syms[right] == b):
                continue
            syms[left] = merged
            alive[right] = False
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
                m = merges.get((merged, syms[after]))
                if m is not None:
                    push(heap, (m[0], left, after, merged, syms[after], m[1]))
            before = prv[left]
            if before >= 0:
                m = merges.get((syms[before], merged))
                if m is not None:
                    push(heap, (m[0], before, left, syms[before], merged, m[1]))
        return [s for s, live in zip(syms, alive, strict=True) if live]
