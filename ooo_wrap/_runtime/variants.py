"""Which scheduler class runs a wrapped model, picked once when it is installed.

Each option that changes the hooks is a subclass overriding them (deferred joins in
``overlap.py``, profiler ranges in ``profiling.py``), so the hooks never test an option
on a call. Both options at once: the deferred hooks wrap the profiled ones, so that
opening and closing a range, a torch operation, happens with the join-on-touch mode quiet.
"""

from __future__ import annotations

from .._compat import deferred_joins_work
from .overlap import DeferredScheduler
from .profiling import ProfiledScheduler
from .scheduler import Scheduler

__all__ = ["scheduler_class"]


class _ProfiledDeferredScheduler(DeferredScheduler, ProfiledScheduler):
    """Deferred joins and profiler ranges."""


def scheduler_class(*, overlap_forward: bool, profile_ranges: bool) -> type[Scheduler]:
    """The scheduler class for these options of ``OOOModule`` (joins at once where this
    torch lacks what deferring them needs: ``_compat`` warns)."""
    if overlap_forward and deferred_joins_work():
        return _ProfiledDeferredScheduler if profile_ranges else DeferredScheduler
    return ProfiledScheduler if profile_ranges else Scheduler
