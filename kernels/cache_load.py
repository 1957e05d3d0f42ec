"""Loads kernels from Numba's disk cache without refreshing its whole CPU target first.

Numba's Cache.load_overload refreshes the target context before every load: it imports and
registers the typing and lowering of all of Numba's numpy, cpython, random, typed-container and
datetime support. A compile needs that; rebuilding a cached kernel does not (its machine code is
linked as it is, and its environment imports the modules it names itself). The refresh is the
largest piece of a warm start-up: about 0.1-0.2 s of SmolLM2's 0.6-0.9 s to its first token on
this machine class. So a cached load here only starts Numba's runtime (NRT), which the rebuilt
code calls; a real compile still refreshes everything (numba.core.compiler does, per compile).

Where Numba's cache class lacks the pieces this relies on (another Numba version), it is left
as it is and loads as before.
"""

from numba.core import caching
from numba.core.runtime import rtsys

_Cache = caching.Cache
_NEEDS = ("load_overload", "_load_overload", "_guard_against_spurious_io_errors")


def _load_overload(self, sig, target_context):
    rtsys.initialize(target_context)
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)
    # None where the guard swallowed an OSError: Numba compiles, as its own load_overload does


def install() -> bool:
    """Make cached loads skip the target refresh; False where this Numba lacks what it needs."""
    if not all(hasattr(_Cache, name) for name in _NEEDS):
        return False
    _Cache.load_overload = _load_overload
    return True
