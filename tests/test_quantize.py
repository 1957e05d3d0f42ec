"""`edgeinfer quantize`: llama.cpp's quantizer behind checks, progress and an atomic output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_checks import edgeinfer as run_edgeinfer
from cli_checks import one_error_line

from edgeinfer.errors import EdgeInferError
from edgeinfer.eval import quantize as q
from edgeinfer.eval.weights import bits_per_weight
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.llm import LLM

# the main tensor type each file type gives the synthetic llama's matrices
MAIN_TYPE = {
    "Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_0": "Q4_0",
    "Q4_1": "Q4_1", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0", "F16": "F16",
    "BF16": "BF16",
}  # fmt: skip


def edgeinfer(*args) -> subprocess.CompletedProcess:
    return run_edgeinfer(*args, timeout=120)


@pytest.fixture(scope="module")
def f32(synthetic_model) -> Path:
    return synthetic_model("llama", "F32")


def test_every_type_quantizes_and_runs(f32, tmp_path):
    assert set(MAIN_TYPE) == set(q.TYPES)
    seen = []
    for t in q.TYPES:
        out = q.quantize(f32, tmp_path / f"{t}.gguf", t, threads=2)
        g = read_gguf(out.path)
        types = [x.qtype.name for x in g.tensors.values() if len(x.shape) == 2]
        assert max(set(types), key=types.count) == MAIN_TYPE[t], (t, types)
        assert out.bits_per_weight == pytest.approx(bits_per_weight(g))
        assert out.size == out.path.stat().st_size and out.source_bits_per_weight == 32.0
        seen.append(out.bits_per_weight)
    bpw = dict(zip(q.TYPES, seen, strict=True))
    assert bpw["Q2_K"] < bpw["Q3_K_M"] < bpw["Q4_K_M"] < bpw["Q5_K_M"] < bpw["Q6_K"]
    assert bpw["Q6_K"] < bpw["Q8_0"] < bpw["F16"] == bpw["BF16"] < 32
    # the output is a model edgeinfer runs
    logits = LLM(str(tmp_path / "Q4_K_M.gguf"), ctx=32).logits([1, 5, 9])
    assert logits.shape[0] == 3


def test_cli_prints_size_and_bits_per_weight(f32, tmp_path):
    dst = tmp_path / "out.gguf"
    r = edgeinfer("quantize", str(f32), str(dst), "q8_0", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{dst}: Q8_0, ")
    assert f"{bits_per_weight(read_gguf(dst)):.2f} bits per weight" in r.stdout
    assert "source 5.7 MiB, 32.00" in r.stdout
    before = dst.read_bytes()
    one_error_line(edgeinfer("quantize", str(f32), str(dst), "Q4_0"), "exists", "--force")
    assert dst.read_bytes() == before
    r = edgeinfer("quantize", str(f32), str(dst), "Q4_0", "--force")
    assert r.returncode == 0, r.stderr
    assert "Q4_0" in read_gguf(dst).tensors["blk.0.attn_q.weight"].qtype.name


def test_cli_user_errors(f32, synthetic_model, tmp_path):
    one_error_line(edgeinfer("quantize", str(f32), str(tmp_path / "a.gguf"), "Q7_K"),
                   "unsupported type", "Q4_K_M")  # fmt: skip
    one_error_line(edgeinfer("quantize", str(tmp_path / "none.gguf"), str(tmp_path / "a.gguf"),
                             "Q8_0"), "none.gguf")  # fmt: skip
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(f32.read_bytes()[:5000])
    one_error_line(edgeinfer("quantize", str(bad), str(tmp_path / "a.gguf"), "Q8_0"), "bad.gguf")
    q4 = synthetic_model("llama", "Q4_K_M")
    one_error_line(edgeinfer("quantize", str(q4), str(tmp_path / "a.gguf"), "Q8_0"),
                   "already quantized", "--allow-requantize")  # fmt: skip
    one_error_line(edgeinfer("quantize", str(f32), str(f32), "Q8_0", "--force"), "overwrite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]
    r = edgeinfer("quantize", str(q4), str(tmp_path / "a.gguf"), "Q8_0", "--allow-requantize")
    assert r.returncode == 0, r.stderr


def test_full_disk_leaves_no_partial_file(f32, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                           capture_output=True)  # fmt: skip
    if mount.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        one_error_line(edgeinfer("quantize", str(f32), str(small / "q.gguf"), "Q8_0"),
                       "no space left", "removed")  # fmt: skip
        assert list(small.iterdir()) == []
        with pytest.raises(EdgeInferError, match="no space left"):
            q.quantize(f32, small / "q.gguf", "F16")
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
