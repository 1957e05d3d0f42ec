"""`edgeinfer run --logprobs`: each generated token's log-probability, checked against a
log-softmax of the model's own logits for the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from llama_oracle import log_softmax

from edgeinfer.llm import LLM

EXE = Path(sys.executable).with_name("edgeinfer")


def edgeinfer(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=300)


def test_run_prints_each_tokens_logprob(synthetic_model):
    path = str(synthetic_model("llama", "F32"))
    args = ("run", path, "-p", "the quick brown", "-n", "6", "--temp", "0", "--ignore-eos",
            "--ctx", "64")  # fmt: skip
    r = edgeinfer(*args, "--json", "--top-logprobs", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    prompt, ids = out["prompt_token_ids"], out["token_ids"]
    assert len(ids) == 6 and len(out["logprobs"]) == 6
    lp = log_softmax(LLM(path, ctx=64).logits(prompt + ids[:-1]))[len(prompt) - 1 :]
    for i, t in enumerate(out["logprobs"]):
        assert t["token_id"] == ids[i]
        assert abs(t["logprob"] - lp[i, ids[i]]) < 1e-3
        assert [tid for tid, _ in t["top"]] == np.argsort(-lp[i])[:2].tolist()  # greedy: best
        assert t["top"][0][0] == ids[i]

    r = edgeinfer(*args, "--logprobs")
    assert r.returncode == 0, r.stderr
    text, _, table = r.stdout.partition("\n\ntoken ")
    rows = table.splitlines()[1:]
    assert len(rows) == 6 and text == out["text"]
    got = [float(row.rsplit('"', 1)[1].split()[0]) for row in rows]
    np.testing.assert_allclose(got, [t["logprob"] for t in out["logprobs"]], atol=1e-4)
    assert all(row.rstrip().endswith("%") for row in rows)  # no alternatives asked for

    r = edgeinfer(*args, "--top-logprobs", "99")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "logprobs" in r.stderr
