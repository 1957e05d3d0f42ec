"""Precision modes (design.md §9): "fast" (the default) runs prompt rows through the int8 GEMM,
"exact" keeps float activations everywhere; one knob, validated once, on the API and the CLI."""

import numpy as np
import pytest
from cli_checks import edgeinfer, one_error_line
from reference_forward import ReferenceModel

from edgeinfer.config import ConfigError, EngineConfig
from edgeinfer.kernels import int8_gemm
from edgeinfer.llm import LLM
from edgeinfer.models.base import ROW_WISE_EXACT, ROW_WISE_INT8


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    return float(((a - ref) ** 2).sum() / (ref**2).sum())


def test_precision_is_validated_once():
    assert EngineConfig().precision == "fast"
    assert EngineConfig(precision="exact").precision == "exact"
    for bad in ("int8", "", None, 1):
        with pytest.raises(ConfigError, match="precision"):
            EngineConfig(precision=bad)


def test_a_bad_precision_flag_is_one_error_line():
    one_error_line(edgeinfer("run", "-p", "Hi", "--precision", "fastest"), "precision", "exact")


def test_the_engine_picks_each_steps_kernels_by_precision(synthetic_model):
    path = str(synthetic_model("llama", "Q4_K_M"))
    fast, exact = LLM(path, ctx=64), LLM(path, ctx=64, precision="exact")
    invariant = LLM(path, ctx=64, batch_invariant=True)
    assert (fast.engine._kernels(decode=False), fast.engine._kernels(decode=True)) == (
        ROW_WISE_INT8,
        False,
    )
    assert (exact.engine._kernels(decode=False), exact.engine._kernels(decode=True)) == (
        ROW_WISE_EXACT,
        ROW_WISE_EXACT,
    )
    kernels = (invariant.engine._kernels(decode=False), invariant.engine._kernels(decode=True))
    assert kernels == (True, True)


@pytest.mark.skipif(not int8_gemm.ENABLED, reason="the target takes the float path")
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_exact_is_float_math_and_fast_rounds_activations(synthetic_model, ftype):
    # on a quantized file, "exact" is the file's own float64 output to float32 rounding, for
    # prompt rows (the chunk) and decode rows (one token at a time) alike; "fast" rounds prompt
    # rows to int8 blocks (the K-quants' GEMM, Q8_0's fused kernel): further, but bounded
    path = synthetic_model("llama", ftype)
    tokens = list(range(3, 40))
    ref = ReferenceModel(path).logits(tokens)
    exact = LLM(str(path), threads=2, ctx=64, precision="exact")
    fast = LLM(str(path), threads=2, ctx=64)
    assert nmse(exact.logits(tokens).astype(np.float64), ref) < 1e-6
    seq = exact.requests.next_id()
    one_by_one = np.concatenate([exact.engine.forward(seq, [t]) for t in tokens])
    assert nmse(one_by_one.astype(np.float64), ref) < 1e-6
    assert 1e-6 < nmse(fast.logits(tokens).astype(np.float64), ref) < 1e-2
