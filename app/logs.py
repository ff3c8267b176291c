"""Routes this application's own log records into the Ray Serve replica's log.

Serve configures only its `ray.serve` logger on a replica (a rotating file under
the session's `logs/serve/` plus the worker's stream); records of the app's and
engine's loggers would otherwise fall to Python's last-resort handler and land in
the Ray worker's stderr file, away from the replica log the dashboard shows. Each
deployment calls `route_app_logs` when its replica starts; calling it again is a no-op.
`log_cancellations_briefly` keeps a client disconnect to one line in that log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import TaskCancelledError

logger = logging.getLogger(__name__)

SERVE_LOGGER = "ray.serve"
# Top-level packages of this project; their module loggers inherit what is set here.
APP_LOGGERS = ("app", "engine", "residency", "disagg", "kernels")


def route_app_logs(level: int = logging.INFO) -> None:
    """Gives the project's loggers the replica logger's handlers (same file, format and context fields)."""
    handlers = logging.getLogger(SERVE_LOGGER).handlers
    for name in APP_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = not handlers  # outside a replica (tests, CLI) records keep their usual path


def log_cancellations_briefly(loop: asyncio.AbstractEventLoop) -> None:
    """Logs cancelled Ray tasks that no one awaited in one line instead of a traceback.

    When a client disconnects while Serve's router is still probing replicas' queue lengths,
    the router abandons its probe tasks; Ray cancels them and asyncio reports each as a
    "Task exception was never retrieved" with a long traceback. That is a disconnect, not a
    failure. Every other unhandled exception keeps the loop's usual report.
    """

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, (TaskCancelledError, asyncio.CancelledError)):
            logger.info("a request was cancelled (client gone): %s", context.get("message", type(exc).__name__))
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
