"""The GGML tensor types edgeinfer runs, each with the kernel family module that implements it.

The one list of supported types: the reader refuses any other type at read time (so `info`,
model load and every other entry point report it the same way), and `kernels.registry` imports
a type's family module (kernels/floats.py, legacy.py, kquants.py) the first time it is needed.
Plain data, so reading a file never imports the kernels.
"""

from edgeinfer.gguf.constants import GGMLQuantizationType as Q

KERNEL_FAMILIES: dict[Q, str] = {
    Q.F32: "floats", Q.F16: "floats", Q.BF16: "floats",
    Q.Q4_0: "legacy", Q.Q4_1: "legacy", Q.Q5_0: "legacy", Q.Q5_1: "legacy", Q.Q8_0: "legacy",
    Q.Q2_K: "kquants", Q.Q3_K: "kquants", Q.Q4_K: "kquants", Q.Q5_K: "kquants",
    Q.Q6_K: "kquants",
}  # fmt: skip

SUPPORTED_TENSOR_TYPES = frozenset(KERNEL_FAMILIES)
