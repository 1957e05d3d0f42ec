"""`edgeinfer pull NAME`: fetch a known model into the local cache (once)."""

from __future__ import annotations

from typing import Annotated

import typer

from edgeinfer.gguf import hub


def pull(
    name: Annotated[
        str, typer.Argument(help=f"short model name ({', '.join(hub.MODELS)})")
    ] = hub.DEFAULT_MODEL,
    list_models: Annotated[
        bool, typer.Option("--list", help="list the known names and exit")
    ] = False,
) -> None:
    """Download a known model (sha256-checked) into $EDGEINFER_HOME and print its path."""
    if list_models:
        for spec in hub.MODELS.values():
            state = "pulled" if hub.model_path(spec.name).is_file() else "not pulled"
            typer.echo(f"{spec.name:<23}{state:<11}{spec.description}")
        return
    typer.echo(hub.pull(name))
