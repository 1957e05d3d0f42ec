"""Speculative decoding: a cheap proposer guesses the next tokens of a sequence, and one forward
pass of the model verifies them all (the engine's decode step carries them as draft tokens).

`Proposer` is the interface a proposer implements; `NgramProposer` looks the sequence's last
tokens up in its own prompt and output (prompt lookup); `DraftModelProposer` runs a smaller
model with the same vocabulary. `Speculator` paces proposals per sequence (adaptive k) and
counts what was proposed and accepted. Acceptance itself is sampling's business
(`Sampler.verify`), so a verified token is distributed exactly as a sampled one.
"""

from edgeinfer.speculative.draft_model import DraftModelProposer
from edgeinfer.speculative.ngram import NgramProposer
from edgeinfer.speculative.proposer import Proposer
from edgeinfer.speculative.speculator import Speculator

DRAFT_PREFIX = "draft:"  # --spec draft:MODEL

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "Speculator", "make_speculator"]


def make_speculator(config, runner) -> Speculator:
    """The Speculator that `config.speculative` names, for the target model of `runner`."""
    method = config.speculative
    if method.startswith(DRAFT_PREFIX):
        proposer = DraftModelProposer(method[len(DRAFT_PREFIX) :], config, runner)
    else:
        proposer = NgramProposer()
    return Speculator(proposer, config.spec_k)
