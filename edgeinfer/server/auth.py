"""API keys: `Authorization: Bearer KEY`, checked in constant time against every key.

Keys are kept as SHA-256 digests (vLLM does the same) and the presented key's digest is
compared with each of them with `hmac.compare_digest`, without stopping at a match, so the
time taken does not tell which key (or how much of one) was right. Logs name a key by the
first hex digits of its digest, never by the key.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from edgeinfer.errors import EdgeInferError


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_name(digest: bytes) -> str:
    return "key-" + digest.hex()[:8]


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise EdgeInferError(f"--api-key-file: cannot read {path}: {e.strerror or e}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise EdgeInferError(f"--api-key-file: {path} holds no key")
    return keys


class KeyChecker:
    def __init__(self, keys: list[str]):
        if any(not k or k != k.strip() for k in keys):
            raise EdgeInferError("an API key must be non-empty, without surrounding spaces")
        self._digests = [_digest(k) for k in dict.fromkeys(keys)]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> str | None:
        """The `Authorization` header -> the key's log name, or None if it matches no key."""
        scheme, _, token = (authorization or "").partition(" ")
        presented = _digest(token.strip() if scheme.lower() == "bearer" else "")
        found = None
        for digest in self._digests:
            if hmac.compare_digest(presented, digest) and found is None:
                found = digest
        return None if found is None else key_name(found)
