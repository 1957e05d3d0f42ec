"""`edgeinfer info` and `edgeinfer pull` through the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EDGEINFER = Path(sys.executable).parent / "edgeinfer"


def cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(EDGEINFER), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str, after_progress=False):
    """Exit 2, nothing on stdout, one `error:` line on stderr (the last one, after any progress
    lines when `after_progress`), no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert after_progress or len(lines) == 1, proc.stderr
    assert lines[-1].startswith("error: ") and not any(ln.startswith("error") for ln in lines[:-1])
    for needle in needles:
        assert needle in lines[-1]


REAL = {
    # name: (architecture, layers, vocab, tokenizer model, chat template)
    "smollm2-135m-instruct": ("llama", 30, 49152, "gpt2", True),
    "gemma3-270m": ("gemma3", 18, 262144, "llama", False),
}


@pytest.mark.parametrize("name", REAL)
def test_info_json_real(name, real_model):
    real_model(name)  # pull outside the timed CLI call
    proc = cli("info", name, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    arch, layers, vocab, tok, template = REAL[name]
    assert info["architecture"] == arch
    assert (info["n_layers"], info["vocab_size"]) == (layers, vocab)
    assert info["tokenizer"]["model"] == tok
    assert info["chat_template"] is template
    hist = info["tensor_types"]
    assert sum(r["params"] for r in hist.values()) == info["n_params"]
    assert sum(r["bytes"] for r in hist.values()) == info["memory"]["weights_bytes"]
    assert info["bits_per_weight"] == pytest.approx(
        info["memory"]["weights_bytes"] * 8 / info["n_params"], abs=1e-3
    )
    assert info["memory"]["fits"] is True
    # memory discipline: what the kernels copy out of the mapping is at most 10 % of the weights
    assert 0 <= info["memory"]["repacked_bytes"] <= info["memory"]["weights_bytes"] // 10


@pytest.mark.parametrize("name", REAL)
def test_info_human_real(name, real_model):
    real_model(name)
    proc = cli("info", name)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert REAL[name][0] in out and "memory plan" in out and "largest context" in out
    for line in out.splitlines():
        if not line.startswith("  file "):  # a path is as long as it is
            assert len(line) <= 80, line


def test_info_options(synthetic_model):
    path = synthetic_model("gemma3", "Q4_K_M")
    proc = cli("info", str(path), "--json", "--ctx", "100", "--parallel", "3", "--kv-dtype", "f32")
    assert proc.returncode == 0, proc.stderr
    mem = json.loads(proc.stdout)["memory"]
    assert (mem["ctx"], mem["parallel"], mem["kv_dtype"]) == (100, 3, "f32")
    # 6 layers x 1 KV head x (128 + 128) x 4 B, 100 tokens -> 7 blocks of 16, 3 sequences
    assert mem["kv_bytes"] == 6 * 1 * 256 * 4 * 112 * 3
    assert mem["sliding_layers"] == 5


def test_malformed_file(tmp_path, synthetic_model):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(synthetic_model("llama", "Q8_0").read_bytes()[:5000])
    assert_clean_error(cli("info", str(bad)), str(bad))


def test_not_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("just text\n")
    assert_clean_error(cli("info", str(bad)), str(bad))


def test_missing_path(tmp_path):
    assert_clean_error(cli("info", str(tmp_path / "absent.gguf")), "no such file")


def test_unknown_name():
    assert_clean_error(cli("info", "llama-70b"), "smollm2-135m-instruct")


def test_usage_error_exits_2(synthetic_model):
    proc = cli("info", str(synthetic_model("llama", "F32")), "--kv-dtype", "q8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_pull_offline_is_clean_error(tmp_path):
    env = {
        "EDGEINFER_HOME": str(tmp_path),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(tmp_path / "none"),
    }
    proc = cli("pull", "gemma3-270m", env=env)
    assert_clean_error(proc, "pip could not download", after_progress=True)


def test_pull_list(tmp_path):
    proc = cli("pull", "--list", env={"EDGEINFER_HOME": str(tmp_path)})
    assert proc.returncode == 0
    assert "smollm2-135m-instruct" in proc.stdout and "not pulled" in proc.stdout


def test_python_dash_m():
    proc = subprocess.run(
        [sys.executable, "-m", "edgeinfer", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "info" in proc.stdout and "pull" in proc.stdout


@pytest.mark.slow
def test_info_gemma_from_nothing(tmp_path):
    """The issue's acceptance check: an empty cache, one command, JSON on stdout."""
    proc = cli("info", "gemma3-270m", "--json", env={"EDGEINFER_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["architecture"] == "gemma3"
    assert (tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf").is_file()
    assert "stored" in proc.stderr


def test_info_plans_a_draft_models_memory_as_a_run_allocates_it(synthetic_model):
    from edgeinfer.gguf.reader import read_gguf
    from edgeinfer.llm import LLM

    target, draft = synthetic_model("llama", "F32"), synthetic_model("llama", "Q8_0")
    args = ("info", str(target), "--ctx", "200", "--parallel", "3", "--spec", f"draft:{draft}")
    proc = cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    plan = info["draft"]
    llm = LLM(str(target), ctx=200, parallel=3, speculative=f"draft:{draft}")
    runner = llm.engine.speculator.proposer.runner
    # 200 tokens round up to 13 blocks, so the target's 39 blocks hold 3 whole contexts
    assert plan["sequences"] == 3 and plan["kv_bytes"] == runner.kv.nbytes
    with read_gguf(draft) as g:
        assert plan["weights_bytes"] == sum(t.nbytes for t in g.tensors.values())
    assert plan["total_bytes"] == sum(
        plan[k] for k in ("weights_bytes", "repacked_bytes", "kv_bytes", "activation_bytes")
    )
    assert plan["fits"] and info["speculative"] == f"draft:{draft}"
    human = cli(*args)
    assert human.returncode == 0 and "draft model plan:" in human.stdout
    assert "(ctx 200 x 3 sequences, every layer every token)" in human.stdout
    # a draft that could not run is refused as a run refuses it
    other = synthetic_model("gemma3", "F32")
    assert_clean_error(cli("info", str(target), "--spec", f"draft:{other}"), "vocabulary")
    assert_clean_error(cli("info", str(target), "--spec", "drafty"), "'ngram' or 'draft:MODEL'")
    assert "prompt lookup" in cli("info", str(target), "--spec", "ngram").stdout
