"""The worker process that owns ggml's RPC client for the engine (started by remote.py).

`python -m edgeinfer.ggml.worker FD`: FD is a socket to the engine, framed and pickled by
multiprocessing.connection. The engine sends the setup, then one step at a time (the residual
stream and the batch's positions, slots and block tables); the worker runs its spans in order,
each a SpanExecutor on its server, and answers with their output. When a server is lost, ggml's
client aborts this process, and the engine sees the connection close: that is why it runs here.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from edgeinfer.errors import EdgeInferError

BATCH_FIELDS = ("token_ids", "positions", "seq_rows", "slots", "block_tables", "logit_rows")


def _load(setup: dict) -> list:
    from edgeinfer.gguf.model_config import ModelConfig
    from edgeinfer.gguf.reader import read_gguf
    from edgeinfer.models import load_model

    from .placement import Span
    from .span import SpanExecutor

    g = read_gguf(setup["path"])
    cfg = ModelConfig.from_gguf(g)
    # every layer and the head left to spans: the model object only states the architecture
    model = load_model(g, cfg, Span(0, cfg.n_layers, True, "rpc"))
    spans = []
    try:
        for part in setup["parts"]:
            spans.append(SpanExecutor(model, g, part, *setup["plan"], threads=1))
    except BaseException:
        for ex in spans:
            ex.close()
        raise
    return spans


def serve(conn: Connection) -> None:
    from edgeinfer.models.base import Batch

    from .executor import total_bytes

    try:
        setup = conn.recv()
    except EOFError:
        return
    try:
        spans = _load(setup)
    except EdgeInferError as e:
        conn.send(("error", str(e)))
        return
    device_bytes = total_bytes(ex.device_bytes for ex in spans)
    conn.send(("ready", [ex.report() for ex in spans], device_bytes))
    try:
        while True:
            try:
                x, fields = conn.recv()
            except EOFError:  # the engine closed: its spans are done
                return
            batch = Batch(**fields)
            try:
                for ex in spans:
                    x = ex(x, batch)
            except EdgeInferError as e:
                conn.send(("error", str(e)))
                continue
            conn.send(("out", x))
    finally:
        for ex in spans:
            ex.close()


if __name__ == "__main__":
    import resource

    # ggml's client aborts this process when a server is lost: an expected end, not a core file
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    serve(Connection(int(sys.argv[1])))
