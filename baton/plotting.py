"""Plots are an extra: matplotlib comes with ``pip install 'baton[plot]'``, not with the server.

A command asked for a plot (``baton bench --plot``) refuses up front when matplotlib is missing; a plot a command
writes on the side (training curves, a reliability diagram) is skipped with one warning line.
"""

from __future__ import annotations

import importlib.util
import logging

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'baton[plot]' (or pip install matplotlib)"


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def missing_message(what: str) -> str:
    return f"{what} needs matplotlib, which is not installed: {INSTALL_HINT}"


def can_plot(what: str) -> bool:
    """True when matplotlib is there; otherwise warn that ``what`` is skipped."""
    if have_matplotlib():
        return True
    logger.warning("%s skipped: matplotlib is not installed (%s)", what, INSTALL_HINT)
    return False
