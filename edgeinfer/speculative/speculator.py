"""Which decoding sequences get a draft this step, of how many tokens, and what came of it.

Adaptive k: a sequence starts at spec_k draft tokens; a fully accepted draft doubles its next
one (up to spec_k), a partly accepted one shrinks it to the accepted length plus one, and a
draft with nothing accepted halves k. A miss, a draft with fewer than half of its tokens
accepted, pauses proposals for 0, 2, 6, 14, ... 64 steps (misses in a row): a first miss is
often a copy that moves on (a quoting summary's next sentence), whose next guess holds. A
verified token costs most of a decode row (the fused kernels take 5x as long for 7 rows as for
1: Q4_1, AVX-512), so a draft pays only where most of its guesses hold: a sequence whose guesses
always fail pays for one extra row every 64 steps (about 1 %), and one whose guesses hold now
and then (free chat) drafts in short spells, while one that copies its prompt keeps k at its
largest.
Drafts share the rows the scheduler leaves them (`Scheduler.draft_room`): many sequences decoding
at once get short drafts, or none. A request's own SamplingParams.spec_k caps its drafts (0: none).
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.speculative.proposer import Proposer

MAX_PAUSE = 64  # steps


@dataclass
class _Pace:
    k: int
    pause: int = 0  # steps to skip before the next proposal
    misses: int = 0  # drafts in a row with nothing accepted


class Speculator:
    def __init__(self, proposer: Proposer, spec_k: int):
        self.proposer = proposer
        self.spec_k = spec_k
        self._pace: dict[int, _Pace] = {}
        self.num_drafts = 0  # verify steps of a sequence (its chunk carried a draft)
        self.num_proposed = 0  # draft tokens verified
        self.num_accepted = 0  # of those, accepted

    def drafts(self, running: list, room: int) -> dict[int, list[int]]:
        """-> seq_id -> draft tokens, for the decoding sequences of `running` that get one,
        all of them together with a row for each decoding sequence within `room` rows."""
        seqs, ks, decoding = [], [], 0
        for seq in running:
            n = len(seq.token_ids)
            if seq.num_computed != n - 1:  # its prompt is still being computed
                continue
            decoding += 1
            if seq.params.spec_k == 0:  # the request asked for no drafts
                continue
            pace = self._pace.setdefault(seq.seq_id, _Pace(self.spec_k))
            if pace.pause:
                pace.pause -= 1
                continue
            # every draft position must fit the context, and more tokens than max_tokens
            # leaves room for are never kept
            k = min(pace.k, seq.params.spec_k or pace.k, seq.max_context - n)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        share = (room - decoding) // len(seqs) if seqs else 0
        if share < 1:
            return {}
        guesses = self.proposer.propose(seqs, [min(k, share) for k in ks])
        return {s.seq_id: g for s, g in zip(seqs, guesses, strict=True) if g}

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A draft of `proposed` tokens was verified and its first `accepted` kept."""
        self.num_drafts += 1
        self.num_proposed += proposed
        self.num_accepted += accepted
        pace = self._pace[seq_id]
        if accepted == proposed:
            pace.k = min(self.spec_k, 2 * max(pace.k, proposed))
        else:
            pace.k = accepted + 1 if accepted else max(1, pace.k // 2)
        if 2 * accepted >= proposed:
            pace.misses = 0
        else:  # a miss: fewer than half of the guesses held
            pace.misses += 1
            pace.pause = min(MAX_PAUSE, 2**pace.misses - 2)

    def counts(self) -> dict[str, int]:
        """The counters, named as EngineStats names them."""
        return {
            "spec_drafts": self.num_drafts,
            "spec_proposed_tokens": self.num_proposed,
            "spec_accepted_tokens": self.num_accepted,
        }

    def forget(self, seq_id: int) -> None:
        self._pace.pop(seq_id, None)
        self.proposer.forget(seq_id)
