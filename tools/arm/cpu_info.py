"""Prints the target Numba compiles the kernels for (make test-arm runs it before each pytest)."""

import platform

import llvmlite.binding as llvm
from numba.core.registry import cpu_target

codegen = cpu_target.target_context.codegen()
# enabled ones only: LLVM's list also names every feature it turned off
enabled = [f for f in codegen._tm_features.split(",") if f.startswith("+")]
features = ",".join(enabled) or "(none given: the CPU's own)"
print(
    f"numba target: {platform.machine()} {llvm.get_process_triple()}, "
    f"cpu {codegen._get_host_cpu_name()}, features {features}",
    flush=True,
)
