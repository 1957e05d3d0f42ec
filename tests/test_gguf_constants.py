"""edgeinfer's copy of the format's numbers against the `gguf` package's, and the reason for the
copy: loading a model must not import that package."""

import subprocess
import sys

import gguf
import pytest

from edgeinfer.gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType


@pytest.mark.parametrize(
    "ours, theirs",
    [(GGUFValueType, gguf.GGUFValueType), (GGMLQuantizationType, gguf.GGMLQuantizationType)],
)
def test_every_type_has_the_packages_name_and_id(ours, theirs):
    assert {t.name: t.value for t in ours} == {
        t.name: t.value for t in theirs if t.name in ours.__members__
    }
    assert len(ours) >= 13


def test_block_sizes_are_the_packages():
    assert set(GGML_QUANT_SIZES) == set(GGMLQuantizationType)
    for t, sizes in GGML_QUANT_SIZES.items():
        assert sizes == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)], t.name


def test_the_types_edgeinfer_runs_are_all_here():
    from edgeinfer.kernels.registry import supported_types

    assert {t.name for t in supported_types()} <= set(GGMLQuantizationType.__members__)


def test_loading_a_model_does_not_import_the_gguf_package(synthetic_model):
    path = synthetic_model("llama", "Q8_0")
    code = (
        "import sys\n"
        "from edgeinfer import LLM\n"
        "import edgeinfer.cli.app\n"
        f"LLM({str(path)!r}, threads=1, ctx=64).tokenizer\n"
        "print('gguf' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
