"""The chat's /stats: besides toggling the panel, it states the model's quantization and bits
per weight (the figure `edgeinfer quantize` and `edgeinfer eval --weights` print)."""

from __future__ import annotations

from test_tui import SHORT, notices, run, send

from edgeinfer.eval.weights import bits_per_weight
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.llm import LLM
from edgeinfer.tui import session as sessions
from edgeinfer.tui.app import ChatApp, ChatOptions
from edgeinfer.tui.widgets import StatsPanel


def test_stats_shows_quantization_and_bits_per_weight(synthetic_model):
    path = synthetic_model("llama", "Q4_K_M")
    llm = LLM(str(path), ctx=64)
    info = sessions.describe(llm, path)
    bpw = bits_per_weight(read_gguf(path))
    assert info.bits_per_weight == bpw and 4.5 < bpw < 5.5
    assert info.tensor_types.startswith("Q4_K x ") and "F32 x 5" in info.tensor_types
    app = ChatApp(ChatOptions(model=str(path), params=SHORT), loaded=(llm, info))

    async def script(pilot):
        await send(pilot, "/stats")
        await pilot.pause()
        assert not app.chat.query_one(StatsPanel).display
        line = notices(app)[-1]
        assert f"Q4_K_M, {bpw:.2f} bits per weight (Q4_K x " in line
        assert line.endswith("Stats panel hidden.")
        await send(pilot, "/stats")
        await pilot.pause()
        assert notices(app)[-1].endswith("Stats panel shown.")

    run(app, (100, 30), script)
