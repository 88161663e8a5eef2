"""Estimated step times recorded next to each benchmark measurement.

:data:`ESTIMATOR` estimates a point's plain and wrapped step with the race checker's own
machinery, so the first GPU runs calibrate the same cost model ``check()`` reports:

1. The point's model is built on the meta device (no memory, no arithmetic: a large point
   costs the host only its op count), wrapped on virtual streams, and trained two steps
   as the suite trains it (zero_grad, forward, loss, backward, SGD with momentum) under
   :func:`ooo_wrap.testing.detect`, which records every op with its estimated device time
   on the reference GPU (``ooo_wrap._planner.cost``). Where the meta device cannot run the model,
   the CPU runs it at the point's sizes instead.
2. The last step's ops are laid out on the estimated time axis exactly as
   :attr:`ooo_wrap.testing.CheckReport.timeline_estimate` does: on the wrapped schedule (host
   launches in order, each stream in order, every wait) for ``wrapped_ms``, and the same
   ops on one stream without fork/join costs for ``plain_ms``.

Assumptions, recorded in each point's ``source``: the reference GPU's public peak numbers,
concurrent kernels sharing the GPU by occupancy, and a bfloat16 point estimated as a model held
in bfloat16 (autocast keeps a few ops in float32; the estimate does not). One estimate per
point, cached: repeats and reruns of a point cost nothing. Estimates are a model's output,
never measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import ooo_wrap
from ooo_wrap._planner.cost import H200, ReferenceGPU
from ooo_wrap.testing import DetectingBackend, detect

# The layout CheckReport.timeline_estimate uses; not part of ooo_wrap.testing's public names.
from ooo_wrap.testing._timeline import lay_out, split_steps

from .measure import Point

__all__ = ["ESTIMATOR", "Estimator", "TraceEstimator", "estimate_times"]

# A cost model's estimate of one point, ``(plain_ms, wrapped_ms)`` per step, or ``None``.
Estimator = Callable[[Point], tuple[float, float] | None]

_STEPS = 2  # the second step is the one laid out: momentum buffers exist, as in steady state


class TraceEstimator:
    """Estimate a point's plain and wrapped step from the checker's trace (module docstring).

    Args:
        streams: side streams, as ``OOOModule(streams=...)`` in the measurement.
        gpu: the reference GPU whose costs the estimate uses.
    """

    def __init__(self, streams: int = 4, gpu: ReferenceGPU = H200) -> None:
        self.streams = streams
        self.gpu = gpu
        self._cache: dict[Point, tuple[float, float] | None] = {}
        self.failures: dict[Point, str] = {}

    @property
    def source(self) -> str:
        """What made the numbers, with its reference GPU and assumptions."""
        return (
            f"cost-model estimate, not measured: the checker's trace on {self.gpu.name}, "
            f"{self.streams} side streams, the point's planner (static if none); kernels "
            "assumed to share the GPU by occupancy; "
            "bfloat16 points as a bfloat16 model (no autocast)"
        )

    def __call__(self, point: Point) -> tuple[float, float] | None:
        if point not in self._cache:
            self._cache[point] = self._estimate(point)
        return self._cache[point]

    def _estimate(self, point: Point) -> tuple[float, float] | None:
        errors = []
        for device in ("meta", "cpu"):
            try:
                return self._estimate_on(point, torch.device(device))
            except Exception as error:  # e.g. an op with no meta kernel: try the CPU
                errors.append(f"{device}: {type(error).__name__}: {error}")
        self.failures[point] = "; ".join(errors)
        return None

    def _estimate_on(self, point: Point, device: torch.device) -> tuple[float, float]:
        spec = point.spec
        dtype = torch.bfloat16 if point.dtype == "bfloat16" else torch.float32
        with torch.random.fork_rng(devices=[]), torch.device(device):
            model = spec.build(seed=0).to(dtype)  # build() seeds: keep the caller's RNG
        inputs, target = spec.make_batch(point.batch, device)
        if inputs.is_floating_point():
            inputs = inputs.to(dtype)
        backend = DetectingBackend()
        # The point's planner (a learned plan is learned on the first of the two steps);
        # a point that names none is estimated with the static plan.
        planner = getattr(point, "planner", None) or "static"
        wrapped = ooo_wrap.OOOModule(model, self.streams, backend=backend, planner=planner)
        if not isinstance(wrapped, ooo_wrap.OOOModule):
            raise RuntimeError(f"the wrapper fell back: {ooo_wrap.events_for(wrapped)}")
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-4, momentum=0.9, foreach=True)
        with detect(backend, keep_alive=[wrapped]) as found:
            for _ in range(_STEPS):
                with found.phase("step"):
                    optimizer.zero_grad(set_to_none=True)
                loss = spec.loss(wrapped(inputs), target)
                torch.autograd.backward(loss)
                with found.phase("step"):
                    optimizer.step()
                del loss
        steps = split_steps(found.ops)
        wrapped_step = lay_out(steps[-1], gpu=self.gpu)
        plain_step = lay_out(steps[-1], one_stream=True, gpu=self.gpu)
        return plain_step.length_us / 1000, wrapped_step.length_us / 1000


# The estimator the suite records next to each measurement (the suite's default streams).
ESTIMATOR: Estimator | None = TraceEstimator()


def estimate_times(point: Point, estimator: Estimator | None) -> dict[str, Any]:
    """The estimated plain and wrapped step times of ``point``, stored next to the measurement.

    Every field is ``None`` when no estimator is given or it has no estimate for the point,
    so a run without a cost model still writes the same JSON shape. The numbers are a
    model's output, never a measurement: ``source`` names the estimator (its ``source``
    attribute where it has one: the reference GPU and the assumptions).
    """
    empty: dict[str, Any] = {"plain_ms": None, "wrapped_ms": None, "source": None}
    if estimator is None:
        return empty
    estimate = estimator(point)
    if estimate is None:
        return empty
    plain_ms, wrapped_ms = estimate
    source = (
        getattr(estimator, "source", None)
        or getattr(estimator, "__qualname__", None)
        or type(estimator).__name__
    )
    return {"plain_ms": float(plain_ms), "wrapped_ms": float(wrapped_ms), "source": source}
