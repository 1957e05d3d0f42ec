"""The executor a model's ggml span gets: a SpanExecutor for each part on a backend of this
process (cpu, cuda), and a RemoteSpans worker for each run of consecutive parts on ggml RPC
servers, called in layer order (each hands the residual stream to the next; the last one's
output is the span's)."""

from __future__ import annotations

from itertools import groupby

import numpy as np

from .placement import Span, is_rpc


def open_executor(model, gguf, path, span: Span, plan: tuple, threads: int):
    """plan: (num_blocks, block_size, kv_dtype, max_tokens, max_logit_rows)."""
    from .remote import RemoteSpans
    from .span import SpanExecutor

    stages = []
    try:
        for remote, run in groupby(span.pieces, key=lambda p: is_rpc(p.backend)):
            if remote:
                stages.append(RemoteSpans(path, gguf, model.config, tuple(run), plan))
            else:
                stages += [SpanExecutor(model, gguf, p, *plan, threads) for p in run]
    except BaseException:
        for s in stages:
            s.close()
        raise
    return stages[0] if len(stages) == 1 else Chain(stages)


def total_bytes(parts) -> dict[str, int]:
    """{what: bytes} of several spans, added up."""
    total: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0) + v
    return total


class Chain:
    """Stages in layer order, used as one executor."""

    def __init__(self, stages: list):
        self.stages = stages

    def __call__(self, x: np.ndarray, batch) -> np.ndarray:
        for stage in self.stages:
            x = stage(x, batch)
        return x

    @property
    def device_bytes(self) -> dict[str, int]:
        return total_bytes(stage.device_bytes for stage in self.stages)

    def make_batch_invariant(self) -> None:
        try:
            for stage in self.stages:
                stage.make_batch_invariant()
        except BaseException:
            self.close()
            raise

    def report(self) -> str:
        return "; ".join(stage.report() for stage in self.stages)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()
