"""The interface every proposer implements."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Proposer(ABC):
    """Guesses how sequences continue. A guess must be a deterministic function of the
    sequence so far, its tokens and the guesses made for it before (a point-mass draft
    distribution, fixed before its verification): that is what `Sampler.verify`'s acceptance
    rule assumes to keep the output distribution unchanged."""

    @abstractmethod
    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """-> for each sequence (anything with `seq_id` and `token_ids`), up to ks[i] tokens
        that may follow its token_ids (fewer, or none, when it has no good guess)."""

    def forget(self, seq_id: int) -> None:  # noqa: B027 (optional: stateless proposers skip it)
        """Drop what is kept about a finished sequence."""

    def kv_report(self) -> str | None:
        """One line on a KV cache of its own, if it keeps one."""
        return None
