"""Estimated step times recorded next to each benchmark measurement.

A cost model (its estimate of the plain and wrapped step time of a point) can be wired in
as ``ESTIMATOR``; until then every point's ``estimate`` fields are ``None``, so the first
GPU runs already have the JSON shape a calibration needs. Estimates are a model's output,
never measurements: the record names the estimator that made them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .measure import Point

__all__ = ["ESTIMATOR", "Estimator", "estimate_times"]

# A cost model's estimate of one point, ``(plain_ms, wrapped_ms)`` per step, or ``None``.
Estimator = Callable[[Point], tuple[float, float] | None]
# The estimator the suite records next to each measurement; ``None`` until a cost model
# is wired in here, and the JSON's ``estimate`` fields stay ``None`` meanwhile.
ESTIMATOR: Estimator | None = None


def estimate_times(point: Point, estimator: Estimator | None) -> dict[str, Any]:
    """The estimated plain and wrapped step times of ``point``, stored next to the measurement.

    Every field is ``None`` when no estimator is given or it has no estimate for the point,
    so a run without a cost model still writes the same JSON shape. The numbers are a
    model's output, never a measurement: ``source`` names the estimator.
    """
    empty: dict[str, Any] = {"plain_ms": None, "wrapped_ms": None, "source": None}
    if estimator is None:
        return empty
    estimate = estimator(point)
    if estimate is None:
        return empty
    plain_ms, wrapped_ms = estimate
    source = getattr(estimator, "__qualname__", None) or type(estimator).__name__
    return {"plain_ms": float(plain_ms), "wrapped_ms": float(wrapped_ms), "source": source}
