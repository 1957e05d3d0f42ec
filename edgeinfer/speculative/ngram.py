"""Prompt lookup: the last n tokens of a sequence (n = max_n down to min_n) are looked up in its
own prompt and output, and the tokens that followed their latest earlier occurrence are the
guess; while the sequence goes on as the guessed passage does, the next guess is that
passage's next tokens. Edits of code, summaries that quote and chats over documents copy long
spans this way.
"""

from __future__ import annotations

from edgeinfer.speculative.proposer import Proposer

NGRAM_MAX = 4
# A lone token's match is weak evidence: in a free chat its drafts miss, and each miss pauses
# the sequence's drafts (speculator._Pace), so the copies that follow go unproposed. From 2
# tokens, SmolLM2's and Gemma 3 270M's code-edit replies took 23 % and 32 % fewer steps, and
# the other workloads of bench/speculative.py about the same number.
NGRAM_MIN = 2


class _Index:
    """For each n, the n-grams of one sequence's tokens -> where the tokens after their latest
    occurrence start. Grown as tokens arrive; the last n-gram (nothing follows it yet) waits."""

    def __init__(self, ns: range):
        self.ns = ns
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ns}
        self.done = 0  # positions p < done have had every n-gram ending at p indexed

    def update(self, tokens: list[int]) -> None:
        for end in range(max(self.done, 1), len(tokens)):
            for n in self.ns:
                if end >= n:
                    self.after[n][tuple(tokens[end - n : end])] = end
        self.done = max(self.done, len(tokens))


class NgramProposer(Proposer):
    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN):
        self.ns = range(max_n, min_n - 1, -1)  # longest match first
        self._index: dict[int, _Index] = {}
        # seq_id -> where its last guess was taken from, and its length then
        self._copied: dict[int, tuple[int, int]] = {}

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self._guess(seq, k) for seq, k in zip(seqs, ks, strict=True)]

    def _guess(self, seq, k: int) -> list[int]:
        tokens = seq.token_ids
        at = self._copy_goes_on(seq.seq_id, tokens)
        if at is None:
            at = self._lookup(seq.seq_id, tokens)
        if at is None:
            self._copied.pop(seq.seq_id, None)
            return []
        self._copied[seq.seq_id] = (at, len(tokens))
        return tokens[at : at + k]

    def _copy_goes_on(self, seq_id: int, tokens: list[int]) -> int | None:
        """Where the span the last guess came from goes on, if every token since followed it.
        A copy keeps its place: the latest earlier occurrence of the last n tokens may be
        another passage that shares them (a docstring's phrase in the next one)."""
        if seq_id not in self._copied:
            return None
        at, then = self._copied[seq_id]
        goes_on = at + len(tokens) - then
        if goes_on < len(tokens) and tokens[at:goes_on] == tokens[then:]:
            return goes_on
        return None

    def _lookup(self, seq_id: int, tokens: list[int]) -> int | None:
        index = self._index.setdefault(seq_id, _Index(self.ns))
        index.update(tokens)
        for n in self.ns:
            if len(tokens) > n:
                at = index.after[n].get(tuple(tokens[-n:]))
                if at is not None:
                    return at
        return None

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)
        self._copied.pop(seq_id, None)
