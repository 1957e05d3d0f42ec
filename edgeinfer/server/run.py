"""Run the app under uvicorn until SIGINT/SIGTERM, then exit cleanly (status 0)."""

from __future__ import annotations

import uvicorn

from edgeinfer.server import logs
from edgeinfer.server.app import create_app
from edgeinfer.server.settings import ServerSettings
from edgeinfer.server.state import ServerState


class _Server(uvicorn.Server):
    """On SIGINT/SIGTERM: stop accepting, abort what is in flight (clients get a 503 error
    event), wait for the responses to end, stop the engine. uvicorn would then re-raise the
    signal, which ends the process with 130 or -15; a requested stop is a success instead."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if captured is not None:
            captured.clear()
        self._state.begin_shutdown()


def run(settings: ServerSettings) -> None:
    """Serve until stopped; a model that fails to load raises its error after the stop."""
    logger = logs.setup(settings.log_format)
    if not settings.loopback and not settings.api_keys:
        logger.warning(
            "binding %s without an API key: anyone who can reach it can use the model"
            " (pass --api-key or --api-key-file)",
            settings.host,
        )
    state = ServerState(settings, logger)
    config = uvicorn.Config(
        create_app(settings, state),
        host=settings.host,
        port=settings.port,
        log_config=None,  # uvicorn's records go through our handler (logs.setup)
        access_log=False,  # the app writes one line per request itself
        timeout_graceful_shutdown=10,
    )
    server = _Server(config, state)
    state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.load_error is not None:
        raise state.load_error
