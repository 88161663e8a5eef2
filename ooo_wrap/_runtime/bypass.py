"""When stage calls run inline on the caller's stream: the reasons and ``disabled()``.

A bypassed stage call runs where its caller runs, with no stream switch, event or
``record_stream``; the scheduler counts it in ``stats.bypasses`` and reports each reason
once as a ``BYPASSED`` event with its message from ``_reasons.MESSAGES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .._reasons import Reason
from .inflight import thread_state

__all__ = ["disabled", "eager_bypass_reason"]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run every wrapped model inline on the caller's stream, in this thread, for a while.

    Useful for an A/B comparison on one model (evaluation under ``torch.no_grad()`` runs
    inline already). It applies to forwards started inside it: the choice is made once
    per forward, when the model is called. Bypassed stage calls are counted in
    ``stats.bypasses`` and reported once as a ``BYPASSED`` event.

    Example::

        >>> with ooo_wrap.disabled():
        ...     loss = model(x).sum()
    """
    local = thread_state
    local.disabled += 1
    try:
        yield
    finally:
        local.disabled -= 1


def eager_bypass_reason() -> str | None:
    """Why stage calls starting now must run inline (``disabled()``, tracing), or ``None``."""
    if thread_state.disabled:
        return Reason.DISABLED
    # Public API, but torch.jit does not re-export it in a way mypy sees as typed.
    if torch.jit.is_tracing():  # type: ignore[attr-defined,no-untyped-call]
        return Reason.TRACING
    return None
