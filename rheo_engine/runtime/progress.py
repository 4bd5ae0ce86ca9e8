"""Waits a person may see: the engine says what it is doing, a front end shows it.

The engine marks its slow first-use work (measuring this machine's step costs) with ``waits``;
by default that does nothing. A front end installs a display with ``set_display`` (the CLI and
the chat: a tqdm line on stderr once a wait passes a second, nothing with --quiet)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ContextManager

Display = Callable[[str], ContextManager[None]]
_display: Display | None = None


def set_display(display: Display | None) -> Display | None:
    """Show every wait from now on with ``display(what)`` (None: show nothing); returns the
    display it replaces, so a caller can put it back."""
    global _display
    before, _display = _display, display
    return before


def waiting(what: str) -> ContextManager[None]:
    """The display of ``what`` while the block runs (nothing without a display)."""
    return contextlib.nullcontext() if _display is None else _display(what)


def waits(what: str):
    """Decorator: the function's calls are waits of ``what``."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with waiting(what):
                return fn(*args, **kwargs)

        return run

    return wrap
