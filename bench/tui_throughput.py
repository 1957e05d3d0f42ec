"""Decode tok/s inside the chat app vs `edgeinfer run`, each as a user starts it.

`edgeinfer run` runs as its own process (--chat --json: the same chat prompt, greedy, EOS
ignored, so both sides compute the same tokens); the app runs headless through Textual's Pilot,
also in a process of its own, and loads the model itself, on its compute thread, as
`edgeinfer chat` does (two apps in one process would leave one's kernel threads spinning
next to the other's).
The UI thread does all its usual work (Markdown appends, stats refreshes, layout and
rendering); only the bytes to a terminal are skipped. Runs alternate (run, app, run, app, ...)
to share the machine's noise. Target: app / run >= 0.9.

    python bench/tui_throughput.py [--model NAME] [-n 128] [--reps 3] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.tui import session as sessions
from edgeinfer.tui.app import ChatApp, ChatOptions

PROMPT = "Write a long story about a lighthouse keeper and a storm."
EDGEINFER = Path(sys.executable).with_name("edgeinfer")


def decode_rate(p: sessions.Progress) -> float:
    """Same definition as Metrics.decode_tok_s: tokens after the first over their time."""
    return (p.generated - 1) / (p.t_last - p.t_first)


def run_side(model: str, tokens: int, threads: int | None) -> float:
    """`edgeinfer run` in its own process -> its decode tok/s."""
    cmd = [str(EDGEINFER), "run", model, "-p", PROMPT, "--chat", "--json", "--temp", "0"]
    cmd += ["-n", str(tokens), "--ignore-eos"] + (["-t", str(threads)] if threads else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"edgeinfer run failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)["metrics"]["decode_tok_s"]


def app_side(args) -> dict:
    """The app in a process of its own -> {tok_s, ui_share, model, quant, threads}."""
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "-n", str(args.tokens)]
    cmd += ["--size", args.size] + (["--threads", str(args.threads)] if args.threads else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"app worker failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def app_worker(options: ChatOptions, size: tuple[int, int]) -> dict:
    """One headless app: load, send the prompt, time the reply's decode."""
    app = ChatApp(options)
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
            info = chat.session.info
            rates.append(
                {
                    "tok_s": decode_rate(chat.session.last),
                    "ui_share": ui_share,
                    "model": info.name,
                    "quant": info.quant,
                    "threads": info.threads,
                }
            )

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
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        options = ChatOptions(args.model, args.threads, None, None, params)
        size = tuple(int(x) for x in args.size.split("x"))
        print(json.dumps(app_worker(options, size)))
        return
    run_rates, app_rates, ui_shares = [], [], []
    for _ in range(args.reps):
        run_rates.append(run_side(args.model, args.tokens, args.threads))
        info = app_side(args)
        app_rates.append(info["tok_s"])
        ui_shares.append(info["ui_share"])
    run_med, app_med = statistics.median(run_rates), statistics.median(app_rates)
    result = {
        "model": info["model"],
        "quant": info["quant"],
        "threads": info["threads"],
        "tokens": args.tokens,
        "run_tok_s": [round(r, 2) for r in run_rates],
        "app_tok_s": [round(r, 2) for r in app_rates],
        "app_ui_cpu_share": [round(u, 3) for u in ui_shares],
        "ratio": round(app_med / run_med, 3),
    }
    if args.json:
        print(json.dumps(result))
        return
    print("| model | threads | `run` tok/s | app tok/s | app / `run` |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {info['model']} {info['quant']} | {info['threads']} | {run_med:.1f} | {app_med:.1f}"
        f" | {result['ratio']:.2f} |"
    )
    print(
        f"(median of {args.reps}; {args.tokens} tokens each; the app's UI thread used"
        f" {statistics.median(ui_shares):.1%} of a core while decoding)"
    )


if __name__ == "__main__":
    main()
