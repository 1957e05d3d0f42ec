"""`edgeinfer run` through the installed entry point, in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgeinfer import LLM, SamplingParams

EXE = Path(sys.executable).with_name("edgeinfer")
SMOL = "smollm2-135m-instruct"
STATS = re.compile(
    r"^prompt \d+ tok, prefill [\d.]+ tok/s \| TTFT \d+ ms"
    r" \| generated \d+ tok, decode ([\d.]+ tok/s|n/a)$"
)


def edgeinfer(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def smol_path(real_model) -> str:
    return str(real_model(SMOL))


def test_run_streams_text_then_stats_line(smol_path):
    prompt = "The capital of France is"
    expected = LLM(smol_path, ctx=256).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12)
    )[0]
    # default model (no MODEL argument) is smollm2
    r = edgeinfer("run", "-p", prompt, "-n", "12", "--temp", "0", "--ctx", "256")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected.text + "\n"
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("KV cache: ") and "(ctx 256 x parallel 1)" in lines[0]
    assert STATS.match(lines[-1]), lines[-1]
    assert f"prompt {len(expected.prompt_token_ids)} tok" in lines[-1]
    assert f"generated {len(expected.token_ids)} tok" in lines[-1]


def test_run_writes_tokens_before_it_finishes(smol_path):
    cmd = [str(EXE), "run", smol_path, "-p", "Once upon a time", "-n", "64", "--ignore-eos"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.read1(1)  # blocks until the first streamed bytes
        assert first
        assert proc.poll() is None  # 64 tokens take far longer than one
        rest = proc.stdout.read()
        assert proc.wait(timeout=300) == 0
        assert len((first + rest).decode()) > 20
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("json_out", [False, True])
def test_run_says_when_the_context_stopped_it(smol_path, json_out):
    args = ["run", smol_path, "-p", "Once upon a time", "--ignore-eos", "--ctx", "32"]
    args += ["--json"] if json_out else []
    full = edgeinfer(*args, "-n", "100")
    assert full.returncode == 0, full.stderr
    note = full.stderr.strip().splitlines()[-1]
    assert note.startswith("note: stopped at the context limit (32 tokens: prompt ")
    prompt, generated = map(int, re.search(r"prompt (\d+) \+ generated (\d+)", note).groups())
    assert prompt + generated == 32
    # stopping at -n is not the context's doing
    short = edgeinfer(*args, "-n", "4")
    assert short.returncode == 0 and "context limit" not in short.stderr


def test_run_json_and_chat(smol_path):
    r = edgeinfer("run", smol_path, "-p", "Say hi.", "--chat", "-n", "8", "--seed", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["chat"] is True and out["finish_reason"] in ("stop", "length")
    assert isinstance(out["text"], str) and 1 <= len(out["token_ids"]) <= 8
    m = out["metrics"]
    assert m["generated_tokens"] == len(out["token_ids"]) and m["prompt_tokens"] > 5
    assert m["ttft_s"] > 0 and m["prefill_tok_s"] > 0
    again = edgeinfer(
        "run", smol_path, "-p", "Say hi.", "--chat", "-n", "8", "--seed", "3", "--json"
    )
    assert json.loads(again.stdout)["token_ids"] == out["token_ids"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["-p", "hi", "--temp", "-1"], "temperature"),
        (["-p", "hi", "--top-p", "0"], "top_p"),
        (["-p", "hi", "-n", "0"], "max-tokens"),
        (["-p", "hi", "--threads", "0"], "threads"),
        (["no-such-model", "-p", "hi"], "no-such-model"),
        (["/nonexistent/model.gguf", "-p", "hi"], "model.gguf"),
        ([], "prompt"),
        (["-p", "hi", "--top-k", "many"], "top-k"),
        (["-p", "hi", "--no-such-flag"], "no-such-flag"),
        (["-p", "word " * 300, "--ctx", "64"], "context"),
        (["-p", "hi", "--ctx", "100000000000"], "KV cache"),
        (["-p", "hi", "--parallel", "0"], "--parallel"),
        (["-p", "hi", "--kv-budget", "lots"], "--kv-budget"),
        (["-p", "hi", "--kv-budget", "1K"], "less than one 16-token block"),
        (["-p", "hi", "--kv-budget", "1M", "-n", "100"], "KV cache holds 32 tokens"),
    ],
)
def test_run_user_errors_are_one_line_exit_2(smol_path, args, message):
    t0 = time.perf_counter()
    r = edgeinfer("run", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert message in lines[0]
    assert r.stdout == ""
    assert time.perf_counter() - t0 < 120
