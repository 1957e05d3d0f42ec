"""Slash commands: what the input line means when it starts with '/'."""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.errors import EdgeInferError

from .session import SETTABLE

# name -> (argument synopsis, what it does); the app has one handler per name.
COMMANDS: dict[str, tuple[str, str]] = {
    "clear": ("", "start a new conversation (keeps the system prompt)"),
    "shift": ("", "drop the oldest turns until the conversation takes half the context"),
    "system": ("[TEXT]", "set the system prompt (no TEXT: show it; '-' removes it)"),
    "set": ("NAME VALUE", f"sampling: {', '.join(SETTABLE)}"),
    "save": ("FILE", "write the transcript (.md or .json)"),
    "stats": ("", "show or hide the stats panel; print the quantization and bits per weight"),
    "help": ("", "this help"),
}
KEYS = (
    ("Enter", "send"),
    ("Esc", "stop the reply"),
    ("PgUp/PgDn", "scroll the conversation"),
    ("Ctrl+L", "clear the conversation"),
    ("Ctrl+Q", "quit"),
)


class CommandError(EdgeInferError):
    """A line that starts with '/' but is not a valid command."""


@dataclass(frozen=True)
class Command:
    name: str
    arg: str  # the rest of the line, stripped


def parse(line: str) -> Command | None:
    """A Command for '/name args', None for an ordinary message ('//' sends a literal '/')."""
    if not line.startswith("/") or line.startswith("//"):
        return None
    name, _, arg = line[1:].partition(" ")
    name = name.lower()
    if name not in COMMANDS:
        raise CommandError(f"unknown command /{name}: /help lists the commands")
    return Command(name, arg.strip())


def message_text(line: str) -> str:
    """The message an ordinary line sends ('//x' sends '/x')."""
    return line[1:] if line.startswith("//") else line


def help_markdown() -> str:
    cmds = [
        f"- `/{name}{' ' + syn if syn else ''}` — {what}" for name, (syn, what) in COMMANDS.items()
    ]
    keys = [f"- **{key}** — {what}" for key, what in KEYS]
    return "\n".join(["**Commands**", "", *cmds, "", "**Keys**", "", *keys])
