"""A kernel loaded from Numba's disk cache runs without Numba's full target refresh (the largest
piece of a warm start-up), and a function compiled after it still gets everything a compile needs,
a cached kernel to link in included.
Each check is a fresh interpreter: the refresh happens once per process."""

import subprocess
import sys

# modules that only Numba's target refresh imports (numba.core.cpu.load_additional_registries)
_REFRESH_ONLY = ("numba.typed.typeddict", "numba.np.random.generator_core")

_SCRIPT = f"""
import sys
import numpy as np
from edgeinfer import kernels

q = np.arange(-16, 16, dtype=np.int8)
block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), q.view(np.uint8)])
assert np.array_equal(kernels.dequantize(block, "Q8_0", (32,)), q.astype(np.float32) * 0.5)
print("after load:", [m for m in {_REFRESH_ONLY!r} if m in sys.modules])

from numba import njit

@njit
def largest_sum(a):  # a typed dict and a sort: typing and lowering from the refresh
    d = {{1: np.sort(a)[::-1][:2].sum()}}
    return d[1]

print("compiled:", largest_sum(np.array([3.0, 1.0, 4.0])))

from edgeinfer.kernels.activations import exp_f32

@njit
def twice_exp(x):  # links the cached exp_f32, whose bitcode a cached load left unparsed
    return exp_f32(x) * np.float32(2.0)

print("linked:", round(float(twice_exp(np.float32(0.0))), 5))
"""


def _run() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_cached_kernels_load_without_the_target_refresh_and_compiles_still_get_it():
    _run()  # compiles the kernel where the disk cache lacks it (that compile refreshes)
    lines = _run()
    assert lines == ["after load: []", "compiled: 7.0", "linked: 2.0"]
