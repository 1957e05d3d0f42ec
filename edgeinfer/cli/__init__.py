"""The `edgeinfer` command line: `app` is the typer app, one module here per command."""
