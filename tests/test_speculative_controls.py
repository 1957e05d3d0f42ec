"""Speculative decoding's controls: `--spec/--spec-k` on the CLI, a request's own `spec_k` on
the server, its counters in /metrics and in the chat's stats panel."""

from __future__ import annotations

import re

import openai
from cli_checks import edgeinfer, one_error_line
from server_proc import ServerProcess
from test_tui import reply_done, run, send

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.llm import LLM
from edgeinfer.server.metrics import Metrics
from edgeinfer.tui import session as sessions
from edgeinfer.tui.app import ChatApp, ChatOptions

# a prompt that repeats itself: its continuation copies it, so drafts are accepted
COPY = "the quick brown fox jumps over the lazy dog " * 6


def test_run_with_spec_prints_the_same_text_and_the_acceptance(synthetic_model):
    path = str(synthetic_model("llama", "F32"))
    args = [path, "-p", COPY, "--temp", "0", "-n", "40", "--ignore-eos", "-t", "1"]
    plain = edgeinfer("run", *args)
    spec = edgeinfer("run", *args, "--spec", "ngram", "--spec-k", "4")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    m = re.search(r"speculative \(ngram\): (\d+) of (\d+) draft tokens accepted", spec.stderr)
    assert m and int(m[2]) > 0, spec.stderr
    one_error_line(edgeinfer("run", path, "-p", "x", "--spec", "eagle"), "--spec", "eagle")
    one_error_line(
        edgeinfer("run", path, "-p", "x", "--spec", "ngram", "--spec-k", "0"), "--spec-k"
    )


def test_a_server_request_turns_its_drafts_off_with_spec_k_0(synthetic_model):
    path = synthetic_model("llama", "F32")
    server = ServerProcess(path, "--spec", "ngram", "--spec-k", "4")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        drafted = "edgeinfer:spec_decode_num_draft_tokens_total"

        def complete(**extra):
            before = server.metric(drafted)
            body = {"ignore_eos": True, **extra}
            out = client.completions.create(
                model=path.name, prompt=COPY, max_tokens=30, temperature=0, extra_body=body
            )
            return out.choices[0].text, server.metric(drafted) - before

        (off, off_drafted), (on, on_drafted) = complete(spec_k=0), complete()
        assert off == on and off_drafted == 0 and on_drafted > 0
        bad = server.post("/v1/completions", {"prompt": "x", "spec_k": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "spec_k"
    finally:
        server.close()


def spec_llm(path) -> LLM:
    llm = LLM(str(path), threads=1, ctx=256, parallel=1, speculative="ngram", spec_k=4)
    ids = llm.tokenizer.encode(COPY)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    return llm


def test_metrics_export_the_draft_counters(synthetic_model):
    llm = spec_llm(synthetic_model("llama", "F32"))
    s = llm.stats()
    assert s.spec_proposed_tokens > 0
    text = Metrics("m", llm.stats).render().decode()
    for name, value in (
        ("spec_decode_num_drafts", s.spec_drafts),
        ("spec_decode_num_draft_tokens", s.spec_proposed_tokens),
        ("spec_decode_num_accepted_tokens", s.spec_accepted_tokens),
    ):
        assert f'edgeinfer:{name}_total{{model_name="m"}} {float(value)}' in text, name


def test_the_stats_panel_shows_the_acceptance(synthetic_model):
    path = synthetic_model("llama", "F32")
    llm = LLM(str(path), threads=1, ctx=256, parallel=1, speculative="ngram", spec_k=4)
    info = sessions.describe(llm, path)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    app = ChatApp(ChatOptions(model=str(path), params=params), loaded=(llm, info))

    async def script(pilot):
        chat = app.chat
        await send(pilot, COPY)
        await reply_done(pilot)
        drafts, proposed, accepted = chat.session.drafts()
        assert proposed > 0
        numbers = str(chat.query_one("#numbers").render())
        rate = f"{accepted / proposed:.0%} · {accepted / drafts:.1f}/step"
        assert re.search(rf"draft\s+{re.escape(rate)}", numbers), numbers

    run(app, (100, 30), script)
