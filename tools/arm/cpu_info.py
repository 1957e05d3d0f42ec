"""Prints the target Numba compiles the kernels for (make test-arm runs it before each pytest)."""

import platform

import llvmlite.binding as llvm
from numba.core.registry import cpu_target

codegen = cpu_target.target_context.codegen()
cpu = codegen._get_host_cpu_name()
# enabled ones only: LLVM's list also names every feature it turned off
enabled = [f for f in codegen._tm_features.split(",") if f.startswith("+")]
features = ",".join(enabled) or f"LLVM's defaults for {cpu}"
print(
    f"numba target: {platform.machine()} {llvm.get_process_triple()}, cpu {cpu}, "
    f"features {features}",
    flush=True,
)
