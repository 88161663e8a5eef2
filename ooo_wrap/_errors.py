"""The one exception hierarchy of ooo_wrap."""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Iterable

__all__ = ["OOOConfigError", "OOOError", "did_you_mean", "positive_int", "warn_user"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class OOOError(RuntimeError):
    """Base class of every error ooo_wrap raises."""


class OOOConfigError(OOOError, ValueError):
    """A wrap-time configuration error: the message names the offender and the fix."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest candidate, or ``""``."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def positive_int(value: object, where: str, hint: str = "") -> int:
    """Return ``value`` if it is a positive int (not a bool), else raise
    :class:`OOOConfigError` naming ``where``; the one such check in the package."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OOOConfigError(f"{where} must be a positive int{hint}, got {value!r}")
    return value


def warn_user(message: str) -> None:
    """``warnings.warn`` attributed to the first frame outside ooo_wrap: the user's line,
    whichever public entry point (``OOOModule``, ``from_config``) led here."""
    frame = inspect.currentframe()
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    warnings.warn(message, stacklevel=level)
