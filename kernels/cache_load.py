"""Loads kernels from Numba's disk cache without refreshing its whole CPU target first.

Numba's Cache.load_overload refreshes the target context before every load: it imports and
registers the typing and lowering of all of Numba's numpy, cpython, random, typed-container and
datetime support. A compile needs that; rebuilding a cached kernel does not (its machine code is
linked as it is, and its environment imports the modules it names itself). The refresh is the
largest piece of a warm start-up: about 0.1-0.2 s of SmolLM2's 0.6-0.9 s to its first token on
this machine class. So a cached load here only starts Numba's runtime (NRT), which the rebuilt
code calls; a real compile still refreshes everything (numba.core.compiler does, per compile).

A cached kernel is its machine code plus the LLVM bitcode of the same code, which Numba parses
at every load (for a later compile that links it in) and scans for the names it defines (the
symbols its engine may look up). Parsing and scanning took 80-100 ms of SmolLM2's first step,
for bitcode no warm run links. So a kernel cached here also records those names, and its bitcode
is parsed only when a compile links it. Entries cached without the names load as before.

Where Numba lacks the pieces either change relies on (another Numba version), it is left as it
is and loads as before.
"""

from numba.core import caching, codegen
from numba.core.runtime import rtsys

_Cache = caching.Cache
_Library = codegen.CPUCodeLibrary
_NEEDS = ("load_overload", "_load_overload", "_guard_against_spurious_io_errors")
_LIBRARY_NEEDS = ("serialize_using_object_code", "_unserialize", "_get_module_for_linking")
# the serialized kind of a library cached with its symbols, unknown to Numba's own _unserialize
_WITH_SYMBOLS = "object+symbols"


def _load_overload(self, sig, target_context):
    rtsys.initialize(target_context)
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)
    # None where the guard swallowed an OSError: Numba compiles, as its own load_overload does


_serialize = _Library.serialize_using_object_code
_unserialize = _Library._unserialize
_module_for_linking = _Library._get_module_for_linking


def _serialize_with_symbols(self):
    name, kind, data = _serialize(self)
    if kind != "object" or len(data) != 2:  # not the layout this reads back: kept as it is
        return name, kind, data
    object_code, shared_bitcode = data
    shared = self._get_module_for_linking()
    symbols = tuple(
        g.name for g in (*shared.functions, *shared.global_variables) if not g.is_declaration
    )
    return name, _WITH_SYMBOLS, (object_code, shared_bitcode, symbols)


def _unserialize_with_symbols(cls, cpu_codegen, state):
    name, kind, data = state
    if kind != _WITH_SYMBOLS:
        return _unserialize.__func__(cls, cpu_codegen, state)
    object_code, shared_bitcode, symbols = data
    self = cpu_codegen.create_library(name)
    self.enable_object_caching()
    self._set_compiled_object(object_code)
    self._edgeinfer_shared_bitcode = shared_bitcode
    self._finalize_final_module()
    cpu_codegen._engine._defined_symbols.update(symbols)
    return self


def _parsed_module_for_linking(self):
    bitcode = getattr(self, "_edgeinfer_shared_bitcode", None)
    if self._shared_module is None and bitcode is not None:
        self._shared_module = codegen.ll.parse_bitcode(bitcode)
    return _module_for_linking(self)


def install() -> bool:
    """Make cached loads skip the target refresh, and cached kernels' bitcode wait for a link;
    False where this Numba lacks what the first needs."""
    if all(hasattr(_Library, name) for name in _LIBRARY_NEEDS) and hasattr(
        codegen.JitEngine(None), "_defined_symbols"
    ):
        _Library.serialize_using_object_code = _serialize_with_symbols
        _Library._unserialize = classmethod(_unserialize_with_symbols)
        _Library._get_module_for_linking = _parsed_module_for_linking
    if not all(hasattr(_Cache, name) for name in _NEEDS):
        return False
    _Cache.load_overload = _load_overload
    return True
