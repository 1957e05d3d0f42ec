"""The server's knobs, validated once (the CLI builds this; everything else only reads it)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.errors import EdgeInferError


@dataclass(frozen=True)
class ServerSettings:
    """model: what `AsyncEngine` loads; model_name: the id clients send and /v1/models lists.
    engine_kwargs: the `LLM` knobs (threads, ctx, parallel, kv_budget, ...).
    max_queue: sequences that may wait for a slot before new requests get 503 (None: no bound).
    rate_per_s / rate_burst: per-key request rate (None: no limit).
    chat_template: a template's source that replaces the model's (--chat-template-file).
    """

    model: str
    model_name: str
    engine_kwargs: dict = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    max_queue: int | None = None
    rate_per_s: float | None = None
    rate_burst: int = 1
    max_body: int = 4 << 20
    log_format: str = "text"
    log_prompts: bool = False
    cors_origins: tuple[str, ...] = ()
    chat_template: str | None = None

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise EdgeInferError(f"--port must be in [0, 65535] (got {self.port})")
        if self.max_queue is not None and self.max_queue < 1:
            raise EdgeInferError(f"--max-queue must be >= 1 (got {self.max_queue})")
        if self.max_body < 1024:
            raise EdgeInferError(f"--max-body must be at least 1K (got {self.max_body})")
        if self.log_format not in ("text", "json"):
            raise EdgeInferError(f"--log-format must be text or json (got {self.log_format!r})")

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def model_name(model: str) -> str:
    """The id a model is served under: a short name as given, a file by its name."""
    return Path(model).name if model.endswith(".gguf") or "/" in model else model
