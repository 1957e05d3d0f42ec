"""The `edgeinfer` command line: one typer app, one module per command."""

from __future__ import annotations

import sys

import typer

from edgeinfer.cli import chat, eval, info, pull, quantize, rpc_server, run, serve
from edgeinfer.errors import EdgeInferError

try:  # recent typer vendors click; older releases use the click package
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

# Plain tracebacks for real bugs: typer's pretty ones can dump locals (whole weight arrays).
app = typer.Typer(
    name="edgeinfer",
    help="CPU-first LLM inference for GGUF models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("chat")(chat.chat)
app.command("info")(info.info)
app.command("pull")(pull.pull)
app.command("run")(run.run)
app.command("serve")(serve.serve)
app.command("quantize")(quantize.quantize)
app.command("eval")(eval.eval_)
app.command("rpc-server")(rpc_server.rpc_server)


def main() -> None:
    """Console entry point: user errors become one `error: ...` line and exit status 2."""
    try:
        # standalone_mode=False hands usage errors to us instead of click's multi-line usage box.
        result = app(standalone_mode=False)
    except click_exceptions.UsageError as e:
        if not e.format_message():  # `edgeinfer` alone: click has already printed the help
            sys.exit(e.exit_code)
        _fail(e.format_message())
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except EdgeInferError as e:
        _fail(str(e))
    except OSError as e:  # unreadable file, full disk: the user's to fix, not a bug
        _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
    sys.exit(result if isinstance(result, int) else 0)


def _fail(message: str) -> None:
    print("error: " + " ".join(message.split()), file=sys.stderr)
    sys.exit(2)
