"""One log line per request, as text (key=value) or JSON, on stderr.

Never the API key (its hash's name instead); the prompt only with --log-prompts.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOGGER = "edgeinfer.server"


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {"message": record.getMessage()}
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return json.dumps(
            {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname.lower(), **fields},
            ensure_ascii=False,
        )


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        if fields is None:
            return super().format(record)
        ts = self.formatTime(record, "%Y-%m-%d %H:%M:%S")
        text = " ".join(f"{k}={_text(v)}" for k, v in fields.items() if v is not None)
        return f"{ts} {record.levelname} {text}"


def _text(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    s = str(v)
    return json.dumps(s, ensure_ascii=False) if (not s or any(c in s for c in ' "=\n')) else s


def setup(log_format: str) -> logging.Logger:
    """The server's logger, writing one line per record to stderr in `log_format`."""
    logger = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(message)s"))
    for name in (LOGGER, "uvicorn"):  # uvicorn's startup and error lines in the same format
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(logging.INFO)
        lg.propagate = False
    return logger


def request_line(logger: logging.Logger, **fields) -> None:
    """fields: id, key, method, path, status, prompt_tokens, output_tokens, cached_tokens,
    ttft_s, duration_s, finish_reason, error, prompt (only with --log-prompts)."""
    logger.info("request", extra={"fields": {"event": "request", **fields}})
