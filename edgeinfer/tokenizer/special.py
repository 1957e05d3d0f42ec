"""Splitting special-token texts out of raw text, before the subword model runs.

llama.cpp takes the special tokens longest first and, for each, cuts every occurrence out of
the text fragments still raw; control and unknown tokens only when special parsing is on,
user-defined ones always. Order matters when texts overlap, so it is reproduced as is; to keep
it cheap, only tokens that occur somewhere in the text are tried, found with one scan.
"""

from __future__ import annotations

import re

from edgeinfer.tokenizer.vocab import CONTROL, LSTRIP, RSTRIP, UNKNOWN, Vocab

# llama.cpp strips with C isspace(): ASCII whitespace only.
_C_SPACE = " \t\n\v\f\r"


class SpecialSplitter:
    def __init__(self, vocab: Vocab):
        self._texts = vocab.tokens
        self._attrs = vocab.attrs
        self._rank = {tid: r for r, tid in enumerate(vocab.special_ids)}
        # Indexed per mode: every special token, or (no special parsing) user-defined ones only.
        self._index = [
            _Index(vocab.special_ids, vocab.tokens),
            _Index(
                [i for i in vocab.special_ids if not vocab.attrs[i] & (CONTROL | UNKNOWN)],
                vocab.tokens,
            ),
        ]

    def split(self, text: str, parse_special: bool) -> list[str | int]:
        """Fragments of `text`: raw strings and special-token ids, in order."""
        if not text:
            return []
        candidates = self._index[0 if parse_special else 1].occurring(text)
        if not candidates:
            return [text]
        fragments: list[str | int] = [text]
        for tid in sorted(candidates, key=self._rank.__getitem__):
            fragments = self._cut(fragments, tid)
        return fragments

    def _cut(self, fragments: list[str | int], tid: int) -> list[str | int]:
        token, attr = self._texts[tid], self._attrs[tid]
        out: list[str | int] = []
        for frag in fragments:
            if isinstance(frag, int) or token not in frag:
                out.append(frag)
                continue
            pos = 0
            while True:
                hit = frag.find(token, pos)
                if hit < 0:
                    break
                left = frag[pos:hit]
                if attr & LSTRIP:
                    left = left.rstrip(_C_SPACE)
                if left:
                    out.append(left)
                out.append(tid)
                pos = hit + len(token)
                if attr & RSTRIP:
                    while pos < len(frag) and frag[pos] in _C_SPACE:
                        pos += 1
            if pos < len(frag):
                out.append(frag[pos:])
        return out


class _Index:
    """Finds which of a set of token texts occur in a string (overlaps included)."""

    def __init__(self, ids: list[int], texts: list[str]):
        self._by_text = {texts[i]: i for i in ids}
        self._trie: dict = {}
        for t in self._by_text:
            node = self._trie
            for ch in t:
                node = node.setdefault(ch, {})
            node[None] = t
        # Start positions of candidate matches: any position whose next characters begin some
        # token; the trie then walks from each one.
        starts = sorted({t[:1] for t in self._by_text})
        self._longest = max(map(len, self._by_text), default=0)
        self._start = re.compile("|".join(map(re.escape, starts))) if starts else None

    def occurring(self, text: str) -> set[int]:
        if self._start is None:
            return set()
        found: set[int] = set()
        trie, by_text = self._trie, self._by_text
        for m in self._start.finditer(text):
            node = trie
            for ch in text[m.start() : m.start() + self._longest]:
                node = node.get(ch)
                if node is None:
                    break
                t = node.get(None)
                if t is not None:
                    found.add(by_text[t])
        return found
