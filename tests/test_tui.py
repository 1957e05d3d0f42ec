"""The chat app driven headless with Textual's Pilot, on the real default model.

Replies are kept to a few tokens: the point is the app's behaviour, not the model's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from textual.widgets import Input, Markdown

from edgeinfer.cli import chat as cmd_chat
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError, ModelNotFoundError
from edgeinfer.llm import LLM
from edgeinfer.tui import session as sessions
from edgeinfer.tui.app import ChatApp, ChatOptions
from edgeinfer.tui.loading import LoadingScreen
from edgeinfer.tui.stats import RateMeter
from edgeinfer.tui.widgets import AssistantTurn, ConversationPane, Notice, StatsPanel, UserTurn

MODEL = "smollm2-135m-instruct"
SHORT = SamplingParams(temperature=0, max_tokens=3)
TIMEOUT_S = 600  # the machine may be shared; a hang still fails


@pytest.fixture(scope="session")
def loaded(real_model):
    """(llm, ModelInfo) of the default model, loaded and warmed up once."""
    real_model(MODEL)
    return sessions.load(MODEL, None, None, lambda message, fraction: None)


def run(app: ChatApp, size: tuple[int, int], script) -> None:
    """Run `script(pilot)` against the app, headless, at a terminal size."""

    async def main():
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: ready(app))
            await pilot.pause()
            await script(pilot)

    asyncio.run(main())


def chat_app(loaded, params: SamplingParams = SHORT, **options) -> ChatApp:
    return ChatApp(ChatOptions(model=MODEL, params=params, **options), loaded=loaded)


def ready(app) -> bool:
    """The chat screen is up and its on_mount has finished (the input gets focus last). The
    screen exists a moment before its widgets do, so an absent Input means not yet."""
    inputs = app.chat.query(Input) if app.chat is not None else []
    return bool(inputs) and app.focused is inputs.first()


async def until(pilot, condition, timeout_s: float = TIMEOUT_S, step_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(step_s)


async def send(pilot, text: str) -> None:
    pilot.app.chat.query_one(Input).value = text
    await pilot.press("enter")


async def reply_done(pilot) -> None:
    chat = pilot.app.chat
    await until(pilot, lambda: not chat.replying)
    await pilot.pause()


def notices(app) -> list[str]:
    return [str(n.render()) for n in app.chat.query(Notice) if not n.has_class("help")]


def screen_text(app) -> list[str]:
    """The screen as lines of plain text, read back from the app's SVG screenshot."""
    svg = app.export_screenshot()
    width = float(re.search(r'<rect x="0" y="0" width="([\d.]+)"', svg).group(1)) / app.size.width
    rows: dict[int, dict[int, str]] = {}
    pattern = r'<text [^>]*x="([\d.]+)"[^>]*clip-path="url\(#[^)]*-line-(\d+)\)">([^<]*)</text>'
    for m in re.finditer(pattern, svg):
        text = html.unescape(m[3]).replace("\xa0", " ")
        row = rows.setdefault(int(m[2]), {})
        col = round(float(m[1]) / width)
        for i, ch in enumerate(text):
            row[col + i] = ch
    return [
        "".join(rows.get(y, {}).get(x, " ") for x in range(app.size.width)).rstrip()
        for y in range(app.size.height)
    ]


# ---- loading --------------------------------------------------------------------------------


def test_loading_screen_then_chat(real_model):
    real_model(MODEL)
    app = ChatApp(ChatOptions(model=MODEL, params=SHORT))
    seen = []

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            seen.append(type(app.screen))  # before any pause: a warm load takes under a second
            await until(pilot, lambda: ready(app))
            await pilot.pause()
            text = "\n".join(screen_text(app))
            assert "loaded in" in text and MODEL.split("-")[0] in text.lower()

    asyncio.run(main())
    assert seen == [LoadingScreen]


def test_loading_error_is_shown_not_raised(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    app = ChatApp(ChatOptions(model=str(bad)))

    async def main():
        async with app.run_test(size=(80, 24)) as pilot:
            error = app.screen.query_one("#error")
            await until(pilot, lambda: "error" in str(error.render()), timeout_s=60)
            assert "bad.gguf" in str(error.render())
            assert isinstance(app.screen, LoadingScreen)

    asyncio.run(main())
    # kept for `edgeinfer chat`, which exits 2 with it once the app closes
    assert app.load_error is not None and "bad.gguf" in app.load_error


def test_chat_command_rejects_a_malformed_file_with_exit_2(synthetic_model, tmp_path):
    good = synthetic_model("llama", "Q8_0").read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(good[: len(good) // 2])
    exe = Path(sys.executable).with_name("edgeinfer")
    # no terminal: an app that started anyway would hang until the timeout
    r = subprocess.run(
        [str(exe), "chat", str(bad)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "truncated.gguf" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_hangup_quits_cleanly(real_model):
    """A dropped SSH session sends SIGHUP: the app quits as ctrl+q does (exit 0), rather than
    dying by the signal mid-write."""
    exe = Path(sys.executable).with_name("edgeinfer")
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(exe), "chat", str(real_model(MODEL))],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "100", "LINES": "30"},
        start_new_session=True,
    )
    os.close(slave)
    screen = b""
    deadline = time.monotonic() + 120
    try:
        while b"loaded in" not in screen and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                screen += os.read(master, 65536)
        assert b"loaded in" in screen
        os.kill(proc.pid, signal.SIGHUP)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


# ---- conversation ---------------------------------------------------------------------------


def test_prompt_streams_tokens_and_stats_then_esc_stops(loaded):
    # ignore_eos: the reply cannot end on its own before Esc
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    app = chat_app(loaded, params)

    async def script(pilot):
        chat = app.chat
        await send(pilot, "Tell me a long story about a lighthouse.")
        await until(pilot, lambda: chat.session.busy and chat.query_one(Markdown).source)
        partial = chat.query_one(Markdown).source
        await until(pilot, lambda: "now" in str(chat.query_one("#rate").render()))
        assert "output" in str(chat.query_one("#numbers").render())
        await pilot.press("escape")
        await reply_done(pilot)
        reply = chat.session.reply
        assert reply.finish_reason == "abort"
        assert 0 < chat.session.last.generated < 400
        shown = chat.query_one(AssistantTurn).query_one(Markdown).source
        assert shown.startswith(partial) and shown == reply.text
        assert chat.session.turns[-1] == {"role": "assistant", "content": reply.text}
        assert "stopped (Esc)" in "\n".join(screen_text(app))
        # the app stays usable after a stop
        await send(pilot, "/set max_tokens 3")
        await send(pilot, "Hi")
        await reply_done(pilot)
        assert len(chat.query(AssistantTurn)) == 2

    run(app, (100, 30), script)


def test_complete_reply_updates_history_and_stats(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        chat = app.chat
        await send(pilot, "What is the capital of France?")
        await reply_done(pilot)
        s = chat.session
        assert [t["role"] for t in s.turns] == ["user", "assistant"]
        assert s.turns[0]["content"] == "What is the capital of France?"
        assert s.last.generated <= SHORT.max_tokens and s.last.ttft_s > 0
        numbers = str(chat.query_one("#numbers").render())
        assert re.search(r"TTFT\s+\d+ ms", numbers)
        assert re.search(rf"output\s+{s.last.generated} tok", numbers)
        assert f"context {s.last.prompt_tokens + s.last.generated}/" in numbers
        assert re.search(r"KV\s+\d+/\d+ blk", numbers)
        assert re.search(r"RSS\s+[\d.]+ [KMG]iB", numbers)
        assert chat.query_one(UserTurn) and chat.query_one(AssistantTurn)
        # the second turn's prompt starts with the first turn: its blocks come from the cache
        first = s.last
        await send(pilot, "And of Germany?")
        await reply_done(pilot)
        history = first.prompt_tokens + first.generated
        assert s.last.cached_tokens >= (history - 1) // 16 * 16 - 16 > 0
        numbers = str(chat.query_one("#numbers").render())
        assert f"{s.last.cached_tokens} cached" in numbers
        assert f"{s.last.prompt_tokens - s.last.cached_tokens} new" in numbers
        # between replies the conversation's blocks are free but kept for the next turn
        cached = chat.session.kv_blocks()[2]
        assert cached >= (s.last.prompt_tokens + s.last.generated) // 16 - 1 > 0
        assert re.search(rf"cache\s+{cached} blk", numbers)

    run(app, (80, 24), script)


def test_enter_while_replying_keeps_the_text(loaded):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    app = chat_app(loaded, params)

    async def script(pilot):
        chat = app.chat
        await send(pilot, "Count to one hundred.")
        await until(pilot, lambda: chat.session.busy)
        await send(pilot, "second message")
        assert chat.query_one(Input).value == "second message"
        assert len(chat.query(UserTurn)) == 1
        await pilot.press("escape")
        await reply_done(pilot)

    run(app, (80, 24), script)


# ---- slash commands -------------------------------------------------------------------------


def test_clear_empties_the_conversation(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        chat = app.chat
        await send(pilot, "Hello")
        await reply_done(pilot)
        assert chat.session.turns
        await send(pilot, "/clear")
        await pilot.pause()
        assert chat.session.turns == [] and chat.session.last is None
        assert not chat.query(UserTurn) and not chat.query(AssistantTurn)
        assert any("New conversation" in n for n in notices(app))

    run(app, (80, 24), script)


def test_system_sets_the_system_prompt(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        chat = app.chat
        await send(pilot, "/system You are a pirate.")
        await pilot.pause()
        assert chat.session.system == "You are a pirate."
        assert chat.session.messages()[0] == {"role": "system", "content": "You are a pirate."}
        await send(pilot, "/system")
        await pilot.pause()
        assert "System prompt: You are a pirate." in notices(app)[-1]
        await send(pilot, "Hi")
        await reply_done(pilot)
        llm = chat.session.llm
        assert "You are a pirate." in llm.tokenizer.decode(
            llm.chat_token_ids(chat.session.messages())
        )
        await send(pilot, "/system -")
        await pilot.pause()
        assert chat.session.system is None
        assert [m["role"] for m in chat.session.messages()] == ["user", "assistant"]

    run(app, (80, 24), script)


def test_set_changes_sampling_params_and_rejects_bad_values(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        chat = app.chat
        for line in ("/set temperature 0.3", "/set top_p 0.5", "/set top_k 7", "/set max_tokens 2"):
            await send(pilot, line)
            await pilot.pause()
        p = chat.session.params
        assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 0.5, 7, 2)
        for bad in ("/set temperature hot", "/set top_p 2", "/set colour 1"):
            await send(pilot, bad)
            await pilot.pause()
            assert notices(app)[-1].startswith("error:")
        assert chat.session.params == p
        await send(pilot, "Hello there")
        await reply_done(pilot)
        assert chat.session.last.generated <= 2

    run(app, (80, 24), script)


@pytest.mark.parametrize("ext", [".md", ".json"])
def test_save_writes_a_parseable_transcript(loaded, tmp_path, ext):
    app = chat_app(loaded, system="Be brief.")
    path = tmp_path / f"chat{ext}"

    replies = []

    async def script(pilot):
        await send(pilot, "Name a colour.")
        await reply_done(pilot)
        replies.append(app.chat.session.turns[-1]["content"])
        await send(pilot, f"/save {path}")
        await pilot.pause()
        assert f"Saved the transcript to {path}" in notices(app)[-1]
        await send(pilot, f"/save {tmp_path / 'chat.txt'}")
        await pilot.pause()
        assert notices(app)[-1].startswith("error:")

    run(app, (80, 24), script)
    text = path.read_text(encoding="utf-8")
    if ext == ".json":
        doc = json.loads(text)
        roles = [m["role"] for m in doc["messages"]]
        assert roles == ["system", "user", "assistant"]
        assert doc["messages"][1]["content"] == "Name a colour."
        assert doc["params"]["temperature"] == 0 and doc["mode"] == "chat"
    else:
        assert re.findall(r"^## (\w+)$", text, re.M) == ["System", "User", "Assistant"]
        assert "Name a colour." in text
    assert replies[0] in text


def test_stats_toggles_the_panel_and_help_lists_commands(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        chat = app.chat
        panel = chat.query_one(StatsPanel)
        assert panel.display
        await send(pilot, "/stats")
        await pilot.pause()
        assert not panel.display
        assert chat.query_one(ConversationPane).region.width == 80
        await send(pilot, "/stats")
        await pilot.pause()
        assert panel.display
        await send(pilot, "/help")
        await pilot.pause()
        help_text = chat.query(Notice).last().query_one(Markdown).source
        names = ("/clear", "/shift", "/system", "/set", "/save", "/stats", "/help", "Esc")
        for name in (*names, "Ctrl+Q"):
            assert name in help_text
        await send(pilot, "/nonsense")
        await pilot.pause()
        assert "unknown command /nonsense" in notices(app)[-1]

    run(app, (80, 24), script)


def test_ctrl_l_clears_and_ctrl_q_quits(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        await send(pilot, "Hi")
        await reply_done(pilot)
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert app.chat.session.turns == []
        await pilot.press("ctrl+q")
        await pilot.pause()

    run(app, (80, 24), script)
    assert app.return_code == 0


def test_context_full_offers_clear_and_shift(real_model):
    llm = LLM(str(real_model(MODEL)), ctx=48)
    info = sessions.describe(llm, real_model(MODEL))
    app = ChatApp(ChatOptions(model=MODEL, params=SHORT), loaded=(llm, info))

    async def script(pilot):
        chat = app.chat
        await send(pilot, "word " * 60)
        await pilot.pause()
        assert "Context full" in notices(app)[-1]
        assert "/clear" in notices(app)[-1] and "/shift" in notices(app)[-1]
        assert chat.session.turns == [] and not chat.query(UserTurn)
        await send(pilot, "/shift")
        await pilot.pause()
        assert "Nothing to drop" in notices(app)[-1]

    run(app, (80, 24), script)


def test_shift_drops_the_oldest_exchanges_until_half_the_context(real_model):
    llm = LLM(str(real_model(MODEL)), ctx=128)
    session = sessions.ChatSession(
        llm, sessions.describe(llm, real_model(MODEL)), "Be brief.", SHORT
    )
    turns = []
    for i in range(6):
        turns += [
            {"role": "user", "content": f"Question {i} about the weather in town?"},
            {"role": "assistant", "content": f"Answer {i}: it is sunny and warm today."},
        ]
    session.turns = list(turns)
    assert len(llm.chat_token_ids(session.messages())) > 64
    dropped = session.shift()
    assert dropped % 2 == 0 and session.turns == turns[dropped:]  # whole exchanges, oldest first
    assert len(llm.chat_token_ids(session.messages())) <= 64
    # one exchange fewer would not have fit: no more was dropped than needed
    assert len(llm.chat_token_ids(session.messages(turns[dropped - 2 :]))) > 64
    assert session.messages()[0] == {"role": "system", "content": "Be brief."}
    assert session.shift() == 0


def test_shift_command_reports_what_the_model_still_sees(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        session = app.chat.session
        long = "story " * session.info.max_context  # more than half the context alone
        session.turns = [
            {"role": "user", "content": long},
            {"role": "assistant", "content": "Once upon a time."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You are welcome."},
        ]
        await send(pilot, "/shift")
        await pilot.pause()
        assert notices(app)[-1].startswith("Dropped the 2 oldest turns")
        assert [t["content"] for t in session.turns] == ["Thanks!", "You are welcome."]

    run(app, (80, 24), script)


def test_base_model_runs_in_completion_mode(real_model):
    path = real_model("gemma3-270m")
    llm = LLM(str(path), ctx=64)
    info = sessions.describe(llm, path)
    assert not info.chat
    app = ChatApp(ChatOptions(model=str(path), params=SHORT), loaded=(llm, info))

    async def script(pilot):
        assert any("completion mode" in n for n in notices(app))
        assert "completion" in "\n".join(screen_text(app))
        await send(pilot, "The capital of France is")
        await reply_done(pilot)
        assert (
            str(app.chat.query(AssistantTurn).first().query_one(".role").render()) == "Completion"
        )
        assert app.chat.session.last.generated > 0

    run(app, (80, 24), script)


# ---- layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_layout(loaded, size):
    width, height = size
    app = chat_app(loaded)

    async def script(pilot):
        chat = app.chat
        await send(pilot, "Hi!")
        await reply_done(pilot)
        lines = screen_text(app)
        assert len(lines) == height and all(len(line) <= width for line in lines)
        assert "edgeinfer" in lines[0]
        assert "Quit" in lines[-1] and "Stop reply" in lines[-1]
        prompt = chat.query_one(Input).region
        assert prompt.bottom == height - 1 and prompt.width == width
        pane = chat.query_one(ConversationPane).region
        stats = chat.query_one(StatsPanel).region
        assert pane.right == stats.x and stats.right == width
        assert pane.width >= 48 and pane.y == stats.y == 1 and pane.bottom == prompt.y
        panel_text = "\n".join(line[stats.x :] for line in lines[stats.y : stats.bottom])
        for label in ("tok/s", "TTFT", "TPOT", "context", "KV", "cache", "RSS", "CPU", "Q4_1"):
            assert label in panel_text
        conversation = "\n".join(line[: pane.right] for line in lines)
        assert "You" in conversation and "Hi!" in conversation and "Assistant" in conversation

    run(app, size, script)


def test_narrow_terminal_hides_the_stats_panel(loaded):
    app = chat_app(loaded)

    async def script(pilot):
        assert not app.chat.query_one(StatsPanel).display
        assert app.chat.query_one(ConversationPane).region.width == 50

    run(app, (50, 20), script)


# ---- pieces ---------------------------------------------------------------------------------


def test_rate_meter_measures_recent_decode_only():
    m = RateMeter(window_s=1.0)
    assert m.rate() is None
    m.add(10.0, 1)  # first token: end of prefill
    m.add(10.5, 51)
    assert m.rate() == pytest.approx(100.0)
    for i in range(1, 11):
        m.add(10.5 + 0.5 * i, 51 + 10 * i)  # slows to 20 tok/s
    assert m.rate() == pytest.approx(20.0)
    m.add(20.0, 151)  # no new token: ignored
    m.add(21.0, 151)
    assert m.rate() is not None


def test_chat_command_rejects_bad_arguments_before_starting():
    with pytest.raises(ModelNotFoundError):
        cmd_chat.chat("no-such-model")
    with pytest.raises(EdgeInferError, match="max-tokens"):
        cmd_chat.chat(MODEL, max_tokens=0)
    with pytest.raises(EdgeInferError, match="temperature"):
        cmd_chat.chat(MODEL, temp=-1.0)


def test_set_param_validation_leaves_params_unchanged(loaded):
    llm, info = loaded
    s = sessions.ChatSession(llm, info, None, SHORT)
    assert s.set_param("top_k", "5") == dataclasses.replace(SHORT, top_k=5)
    for name, value in (("top_k", "1.5"), ("temperature", "-1"), ("seed", "3")):
        with pytest.raises(EdgeInferError):
            s.set_param(name, value)
    assert s.params == dataclasses.replace(SHORT, top_k=5)
    # -1 means no limit, as `-n -1` does on the command line
    assert s.set_param("max_tokens", "-1").max_tokens is None


def test_describe_uses_the_loaded_model_not_the_file(loaded, tmp_path):
    llm, info = loaded
    # the runner already parsed the file: describing the model must not parse it again
    again = sessions.describe(llm, tmp_path / "moved-away.gguf", MODEL)
    assert dataclasses.replace(again, path=info.path) == info
    assert again.threads == llm.threads


def test_widgets_do_not_import_other_commands():
    code = "import sys, edgeinfer.tui.widgets; print('edgeinfer.cli.info' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
