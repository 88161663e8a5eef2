"""The one exception hierarchy of ooo_wrap."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["OOOConfigError", "OOOError", "did_you_mean"]


class OOOError(RuntimeError):
    """Base class of every error ooo_wrap raises."""


class OOOConfigError(OOOError, ValueError):
    """A wrap-time configuration error: the message names the offender and the fix."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest candidate, or ``""``."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
