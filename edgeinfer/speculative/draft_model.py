"""A draft model: a second, smaller GGUF with the target's vocabulary guesses greedily.

It has its own ModelRunner and KV cache (as many tokens as the target's) and its own block
bookkeeping; the target's scheduler never sees them. Each proposal first brings the draft's
cache up to the sequence's tokens (a prompt the first time; afterwards the accepted draft tokens
and the bonus token, after rolling back the rejected ones), then decodes k tokens greedily for
all sequences at once. A sequence the draft's cache cannot hold gets no draft.
"""

from __future__ import annotations

from edgeinfer.engine.block_manager import BlockManager, KVCacheFullError
from edgeinfer.engine.kv_cache import BLOCK_SIZE
from edgeinfer.engine.memory_plan import draft_sequences
from edgeinfer.engine.scheduler import Chunk
from edgeinfer.errors import EdgeInferError
from edgeinfer.speculative.proposer import Proposer


class DraftModelProposer(Proposer):
    def __init__(self, model: str, config, target):
        """model: the draft's path or short name; config: the target's EngineConfig;
        target: the target's ModelRunner."""
        from dataclasses import replace

        from edgeinfer.engine.runner import ModelRunner

        # as many cached tokens as the target, in whole contexts; the target's layer offload
        # names the target's layers, so the draft runs on the CPU
        draft_config = replace(
            config,
            ctx=target.max_context,
            parallel=draft_sequences(target.num_blocks, target.max_context),
            kv_budget=None,
            speculative=None,
            offload=None,
            gpu_layers=None,
            rpc=None,
        )
        self.runner = ModelRunner(model, draft_config, window_capped=False)
        check_same_vocab(self.runner.gguf, target.gguf, model)
        self.blocks = BlockManager(self.runner.num_blocks, BLOCK_SIZE, prefix_caching=False)
        self.budget = config.max_num_batched_tokens
        self._cached: dict[int, list[int]] = {}  # seq_id -> tokens whose K/V the draft holds
        self._known: dict[int, int] = {}  # seq_id -> leading tokens known to be the sequence's

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in seqs]
        # sequence index -> the chunk whose logits give its next guess
        pending = {i: c for i, seq in enumerate(seqs) if (c := self._catch_up(seq)) is not None}
        while pending:
            order = list(pending)
            rows = self._run([pending[i] for i in order])
            pending = {}
            for i, row in zip(order, rows, strict=True):
                guesses[i].append(int(row.argmax()))
                if len(guesses[i]) < ks[i]:
                    chunk = self._extend(seqs[i].seq_id, guesses[i][-1:])
                    if chunk is not None:
                        pending[i] = chunk
        return guesses

    def kv_report(self) -> str:
        return self.runner.kv_report()

    def forget(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        self._cached.pop(seq_id, None)
        self._known.pop(seq_id, None)

    # -- the draft's cache -------------------------------------------------------------------

    def _catch_up(self, seq) -> Chunk | None:
        """Roll back the draft tokens the target rejected, compute the tokens the draft has not
        seen but the last, and return the last one's chunk (its logits give the first guess);
        None (and the sequence forgotten) when the draft's cache is full."""
        seq_id, tokens = seq.seq_id, seq.token_ids
        cached = self._cached.setdefault(seq_id, [])
        # a sequence's tokens never change, only grow; the last one always runs (its logits)
        end = min(len(cached), len(tokens) - 1)
        keep = min(self._known.get(seq_id, 0), end)
        while keep < end and cached[keep] == tokens[keep]:
            keep += 1
        if keep < len(cached):
            self.blocks.rollback(seq_id, len(cached) - keep)
            del cached[keep:]
        todo = tokens[keep:-1]
        for i in range(0, len(todo), self.budget):
            chunk = self._extend(seq_id, todo[i : i + self.budget], wants_logits=False)
            if chunk is None:
                return None
            self.runner.execute([chunk], row_wise=True)
        self._known[seq_id] = len(tokens)
        return self._extend(seq_id, tokens[-1:])

    def _extend(self, seq_id: int, tokens: list[int], wants_logits: bool = True) -> Chunk | None:
        """A chunk of tokens after seq_id's draft cache, their slots handed out; None (and the
        sequence forgotten) when the cache is full."""
        cached = self._cached[seq_id]
        try:
            slots = self.blocks.append(seq_id, len(tokens))
        except KVCacheFullError:
            self.forget(seq_id)
            return None
        chunk = Chunk(None, tokens, len(cached), slots, self.blocks.block_table(seq_id))
        chunk.wants_logits = wants_logits
        cached += tokens
        return chunk

    def _run(self, chunks: list[Chunk]) -> list:
        rows = []
        for i in range(0, len(chunks), self.budget):
            rows += self.runner.execute(chunks[i : i + self.budget], row_wise=False)
        return rows


def check_same_vocab(draft, target, name: str) -> None:
    """The draft must speak the target's tokens: the same token strings and special ids."""

    def vocab(g):
        specials = {
            k: v for k, v in g.metadata.items() if k.startswith("tokenizer.ggml.") and "_id" in k
        }
        return g.get("tokenizer.ggml.tokens") or [], specials

    (d_tokens, d_special), (t_tokens, t_special) = vocab(draft), vocab(target)
    if len(d_tokens) != len(t_tokens):
        raise EdgeInferError(
            f"draft model {name}: {len(d_tokens)} tokens, the target has {len(t_tokens)}; "
            "a draft model needs the target's vocabulary"
        )
    diff = next(
        (i for i, (a, b) in enumerate(zip(d_tokens, t_tokens, strict=True)) if a != b), None
    )
    if diff is not None:
        raise EdgeInferError(
            f"draft model {name}: token {diff} is {d_tokens[diff]!r}, the target's is "
            f"{t_tokens[diff]!r}; a draft model needs the target's vocabulary"
        )
    if d_special != t_special:
        key = sorted(
            k for k in d_special.keys() | t_special.keys() if d_special.get(k) != t_special.get(k)
        )[0]
        raise EdgeInferError(
            f"draft model {name}: {key} is {d_special.get(key)}, the target's is "
            f"{t_special.get(key)}; a draft model needs the target's special tokens"
        )
