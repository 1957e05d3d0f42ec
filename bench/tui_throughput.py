"""Decode tok/s inside the chat app vs the plain streaming loop of `edgeinfer run`.

Both sides use one loaded model, the same chat prompt, greedy sampling and ignore_eos, so they
compute exactly the same tokens; runs alternate (run, app, run, app, ...) to share the machine's
noise. The app runs headless through Textual's Pilot: the UI thread does all its usual work
(Markdown appends, stats refreshes, layout and rendering), only the bytes to a terminal are
skipped. Target: app / run >= 0.9.

    python bench/tui_throughput.py [--model NAME] [-n 128] [--reps 3] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

from edgeinfer.sampling import SamplingParams
from edgeinfer.tui import session as sessions
from edgeinfer.tui.app import ChatApp, ChatOptions

PROMPT = "Write a long story about a lighthouse keeper and a storm."


def decode_rate(p: sessions.Progress) -> float:
    """Same definition as Metrics.decode_tok_s: tokens after the first over their time."""
    return (p.generated - 1) / (p.t_last - p.t_first)


def run_side(llm, ids: list[int], params: SamplingParams) -> float:
    """What `edgeinfer run` does: iterate the stream, taking each delta."""
    out = []
    stream = llm.stream(ids, params)
    for delta in stream:
        out.append(delta)
    return stream.completion.metrics.decode_tok_s


def run_side_in_thread(llm, ids: list[int], params: SamplingParams) -> float:
    """The same loop on a worker thread, as the app runs it: the difference to the app is the
    UI's own cost. (With OpenMP's default active waiting on a busy machine, the main thread's
    kernel team can be several times slower than a worker thread's.)"""
    rates = []
    t = threading.Thread(target=lambda: rates.append(run_side(llm, ids, params)))
    t.start()
    t.join()
    return rates[0]


def app_side(loaded, params: SamplingParams, size: tuple[int, int]) -> tuple[float, float]:
    """-> (decode tok/s, share of one core the UI thread used while decoding)."""
    app = ChatApp(ChatOptions(params=params), loaded=loaded)
    rates = []

    async def main():
        async with app.run_test(size=size) as pilot:
            while app.chat is None or app.focused is not app.chat.query_one("#prompt"):
                await pilot.pause(0.05)
            chat = app.chat
            chat.query_one("#prompt").value = PROMPT
            await pilot.press("enter")
            while chat.session.reply.progress().generated < 1:
                await asyncio.sleep(0.01)
            cpu, wall = time.thread_time(), time.perf_counter()
            while chat.replying:
                await asyncio.sleep(0.05)
            ui_share = (time.thread_time() - cpu) / (time.perf_counter() - wall)
            rates.append((decode_rate(chat.session.last), ui_share))

    asyncio.run(main())
    return rates[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--size", default="100x30", help="terminal size of the headless app")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm, info = sessions.load(args.model, args.threads, None, lambda msg, frac: None)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ids = llm.chat_token_ids([{"role": "user", "content": PROMPT}])
    size = tuple(int(x) for x in args.size.split("x"))

    run_rates, thread_rates, app_rates, ui_shares = [], [], [], []
    for _ in range(args.reps):
        run_rates.append(run_side(llm, ids, params))
        thread_rates.append(run_side_in_thread(llm, ids, params))
        rate, ui_share = app_side((llm, info), params, size)
        app_rates.append(rate)
        ui_shares.append(ui_share)
    run_med, app_med = statistics.median(run_rates), statistics.median(app_rates)
    thread_med = statistics.median(thread_rates)
    result = {
        "model": info.name,
        "quant": info.quant,
        "threads": info.threads,
        "prompt_tokens": len(ids),
        "tokens": args.tokens,
        "load_s": round(load_s, 2),
        "run_tok_s": [round(r, 2) for r in run_rates],
        "run_thread_tok_s": [round(r, 2) for r in thread_rates],
        "app_tok_s": [round(r, 2) for r in app_rates],
        "app_ui_cpu_share": [round(u, 3) for u in ui_shares],
        "ratio": round(app_med / run_med, 3),
        "ratio_same_thread_kind": round(app_med / thread_med, 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        "| model | threads | `run` tok/s | `run` loop on a thread tok/s | app tok/s"
        " | app / `run` | app / thread loop |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {info.name} {info.quant} | {info.threads} | {run_med:.1f} | {thread_med:.1f}"
        f" | {app_med:.1f} | {result['ratio']:.2f} | {result['ratio_same_thread_kind']:.2f} |"
    )
    print(
        f"(median of {args.reps}; each: {args.tokens} tokens after a {len(ids)}-token prompt;"
        f" the app's UI thread used {statistics.median(ui_shares):.1%} of a core while decoding)"
    )


if __name__ == "__main__":
    main()
