"""/save: the conversation as Markdown or JSON, chosen by the file's extension."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from edgeinfer.errors import EdgeInferError

from .session import ChatSession

FORMATS = (".md", ".json")


def save(session: ChatSession, path: str | Path) -> Path:
    """Write the transcript; a bad extension or an unwritable path raises EdgeInferError."""
    path = Path(path).expanduser()
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise EdgeInferError(f"/save writes {' or '.join(FORMATS)} files, not {path.name!r}")
    text = to_json(session) if suffix == ".json" else to_markdown(session)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise EdgeInferError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def to_json(session: ChatSession) -> str:
    info = session.info
    doc = {
        "model": info.name,
        "quantization": info.quant,
        "path": str(info.path),
        "mode": "chat" if info.chat else "completion",
        "params": dataclasses.asdict(session.params),
        "messages": session.messages(),
    }
    return json.dumps(doc, ensure_ascii=False, indent=2) + "\n"


def to_markdown(session: ChatSession) -> str:
    info = session.info
    parts = [f"# Chat with {info.name} ({info.quant})"]
    for m in session.messages():
        parts.append(f"## {m['role'].capitalize()}\n\n{m['content']}")
    return "\n\n".join(parts) + "\n"
