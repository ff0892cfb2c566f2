"""Run foreign code (a plugin's import or hook, a backend under test) for at most a given
time. Python cannot stop a thread: a call past its limit is left running in a daemon thread
(it ends with the process) and the caller is told, so it never waits forever on a plugin."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Stalled(Exception):
    """The call ran past its limit and is left running; the argument is its worker thread."""


class OwnInterrupt(Exception):
    """A ``KeyboardInterrupt`` the foreign code raised itself (in the worker thread, which
    Ctrl-C never reaches): a bug to report, not the user asking the host to stop."""

    def __str__(self) -> str:
        return ("raised by the plugin's own code, not by Ctrl-C"
                + (f": {self.args[0]}" if self.args and self.args[0] else ""))


def bounded(fn: Callable[[], T], timeout: float | None, name: str = "attnhub-plugin") -> T:
    """``fn()`` in a daemon thread, waited for at most ``timeout`` seconds (:class:`Stalled`
    after that; None: in this thread, no limit). Its exception, ``SystemExit`` too, is
    re-raised here; a ``KeyboardInterrupt`` as :class:`OwnInterrupt`."""
    if timeout is None:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except KeyboardInterrupt as exc:
            box["error"] = OwnInterrupt(safe_str(exc))
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise Stalled(worker)
    if "error" in box:
        raise box["error"]
    return box.get("value")  # type: ignore[return-value]


def safe_str(exc: BaseException) -> str:
    """``str(exc)`` that cannot raise: a plugin's exception whose ``__str__`` raises crashed
    the host while it recorded that plugin as broken. What ``__str__`` raises, even
    KeyboardInterrupt, is the plugin's code (a Ctrl-C landing inside it is the only loss)."""
    try:
        return str(exc)
    except BaseException as inner:  # SystemExit, KeyboardInterrupt too: the plugin's own raise
        return f"<{type(exc).__name__}: str() raised {type(inner).__name__}>"
