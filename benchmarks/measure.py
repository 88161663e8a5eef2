"""Measure one benchmark point: plain vs wrapped, same model, shapes, precision and seed.

For one :class:`Point` (model spec, batch size, precision) on one device:

1. One reference model is built from a fixed random seed; each side is a deep copy of it, so plain
   and wrapped start from identical parameters. Inputs and targets are made once and
   shared by both sides.
2. Memory phase, each side alone: the peak device memory (allocated, and reserved by the
   caching allocator) of a few steps of that side (``reset_peak_memory_stats`` first, the
   memory already held before the side was built subtracted). These are also each side's
   first steps, reported as such.
3. Timing phase, both sides resident: steps interleaved plain, wrapped, plain, wrapped...
   so that clock and thermal drift hit both alike. Every step is synchronized before and
   after, so a step's time is what the caller waits for: zero_grad, forward (under
   autocast for bfloat16), loss, backward, optimizer step. The first ``warmup`` steps of
   each side are reported apart from the ``steps`` steady-state ones.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torch import nn

import ooo_wrap

from .models import ModelSpec

__all__ = ["DTYPES", "Dtype", "Point", "measure_point", "summarize_times"]

Dtype = Literal["float32", "bfloat16"]
DTYPES: tuple[Dtype, ...] = ("float32", "bfloat16")
_AUTOCAST: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}
SIDES = ("plain", "wrapped")


@dataclass(frozen=True)
class Point:
    """One measured configuration: a model at one size, a batch size and a precision."""

    spec: ModelSpec
    batch: int
    dtype: Dtype
    planner: str = ""  # OOOModule(planner=...) when the suite measures a chosen one

    def __str__(self) -> str:
        planner = f" planner={self.planner}" if self.planner else ""
        return f"{self.spec.label} batch={self.batch} {self.dtype}{planner}"


class _Side:
    """One side of the comparison: a model copy, its optimizer, and how to train one step."""

    def __init__(self, name: str, model: nn.Module, lr: float) -> None:
        self.name = name
        self.model = model
        # Momentum gives the optimizer per-parameter state, as real training has.
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step(
        self, spec: ModelSpec, batch: tuple[torch.Tensor, torch.Tensor], dtype: Dtype
    ) -> torch.Tensor:
        inputs, target = batch
        self.optimizer.zero_grad(set_to_none=True)
        autocast_dtype = _AUTOCAST[dtype]
        precision = (
            torch.autocast(inputs.device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with precision:
            output = self.model(inputs)
        loss = spec.loss(output, target)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def summarize_times(seconds: list[float], batch: int) -> dict[str, float]:
    """Median, p10 and p90 in milliseconds, and samples per second at the median."""
    ms = [s * 1e3 for s in seconds]
    if len(ms) >= 2:
        deciles = statistics.quantiles(ms, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = ms[0]
    median = statistics.median(ms)
    return {
        "median_ms": median,
        "p10_ms": p10,
        "p90_ms": p90,
        "samples_per_s": batch / (median / 1e3),
    }


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _stats(model: nn.Module) -> dict[str, int] | None:
    if not isinstance(model, ooo_wrap.OOOModule):
        return None
    snapshot = model.stats
    return {f.name: getattr(snapshot, f.name) for f in fields(snapshot)}


def measure_point(
    point: Point,
    device: torch.device,
    *,
    warmup: int = 5,
    steps: int = 30,
    mem_steps: int = 3,
    streams: int = 4,
    seed: int = 0,
    lr: float = 1e-4,
    backend: Any = None,
    planner: str = "dataflow",
    overlap_forward: bool = False,
) -> dict[str, Any]:
    """Measure ``point`` on ``device``; returns the JSON-ready record of both sides.

    Args:
        point: the model, batch size and precision.
        device: where to run; peak memory is measured on CUDA only (``None`` elsewhere).
        warmup: timed steps per side reported apart, before the steady state.
        steps: steady-state steps per side.
        mem_steps: steps per side, each side alone, over which peak memory is taken.
        streams: the ``streams`` given to :class:`ooo_wrap.OOOModule`.
        seed: seeds the model's parameters and the batch.
        lr: SGD learning rate (momentum 0.9); small, so that nothing diverges.
        backend: passed to :class:`ooo_wrap.OOOModule`; ``None`` for the real device
            (the tests pass a ``SimulatedBackend`` to run this code on a CPU).
        planner: ``OOOModule(planner=...)``: ``"dataflow"`` learns the plan on the wrapped
            side's first step (a warm-up or memory step, inline), ``"static"`` does not.
        overlap_forward: wrap with ``overlap_forward=True`` (deferred joins).
    """
    if steps < 1 or warmup < 0 or mem_steps < 1:
        raise ValueError("need steps >= 1, warmup >= 0 and mem_steps >= 1")
    spec = point.spec
    sync = _synchronizer(device)
    on_cuda = device.type == "cuda"
    with torch.device(device):  # initialise on the device: large models build much faster
        reference = spec.build(seed)
    batch = spec.make_batch(point.batch, device, seed)

    def make_side(name: str, reference: nn.Module) -> _Side:
        model = copy.deepcopy(reference)
        if name == "wrapped":
            model = ooo_wrap.OOOModule(
                model,
                streams=streams,
                backend=backend,
                planner=planner,  # type: ignore[arg-type]
                overlap_forward=overlap_forward,
            )
        return _Side(name, model, lr)

    record: dict[str, Any] = {
        "model": spec.family,
        "label": spec.label,
        "size": spec.size,
        "batch": point.batch,
        "dtype": point.dtype,
        "planner": planner,
    }

    # Memory phase: each side alone on the device (besides the reference and the batch).
    for name in SIDES:
        sync()
        base = base_reserved = 0
        if on_cuda:  # free what earlier points left, so that it is not counted (or held)
            gc.collect()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            base_reserved = torch.cuda.memory_reserved(device)
            torch.cuda.reset_peak_memory_stats(device)
        side = make_side(name, reference)
        first: list[float] = []
        for _ in range(mem_steps):
            sync()
            start = time.perf_counter()
            side.step(spec, batch, point.dtype)
            sync()
            first.append(time.perf_counter() - start)
        record[name] = {"first_steps_ms": [s * 1e3 for s in first]}
        # Allocated is what tensors use; reserved adds what the caching allocator holds,
        # which side streams can raise (a freed block is reused only on its own stream).
        record[name]["peak_memory_bytes"] = (
            torch.cuda.max_memory_allocated(device) - base if on_cuda else None
        )
        record[name]["peak_reserved_bytes"] = (
            torch.cuda.max_memory_reserved(device) - base_reserved if on_cuda else None
        )
        del side

    # Timing phase: both sides resident, steps interleaved A/B/A/B.
    sides = [make_side(name, reference) for name in SIDES]
    del reference  # two copies on the device from here on, not three
    wrapped_model = sides[1].model
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    losses: dict[str, torch.Tensor] = {}
    stats_before = _stats(wrapped_model)
    for i in range(warmup + steps):
        if i == warmup:
            stats_before = _stats(wrapped_model)
        for side in sides:
            sync()
            start = time.perf_counter()
            losses[side.name] = side.step(spec, batch, point.dtype)
            sync()
            times[side.name].append(time.perf_counter() - start)
    stats_after = _stats(wrapped_model)

    for name in SIDES:
        record[name].update(summarize_times(times[name][warmup:], point.batch))
        record[name]["warmup_ms"] = [s * 1e3 for s in times[name][:warmup]]
        record[name]["final_loss"] = float(losses[name])

    wrapped = record["wrapped"]
    wrapped["active"] = stats_after is not None
    wrapped["events"] = [str(event) for event in ooo_wrap.events_for(wrapped_model)]
    if isinstance(wrapped_model, ooo_wrap.OOOModule) and stats_after is not None:
        assert stats_before is not None
        wrapped["stages"] = len(wrapped_model.plan.stages)
        wrapped["streams"] = wrapped_model.plan.num_streams
        wrapped["stats_per_step"] = {
            key: (stats_after[key] - stats_before[key]) / steps for key in stats_after
        }
    record["speedup"] = record["plain"]["median_ms"] / wrapped["median_ms"]
    for key, ratio in (
        ("peak_memory_bytes", "memory_ratio"),
        ("peak_reserved_bytes", "reserved_ratio"),
    ):
        plain_peak, wrapped_peak = record["plain"][key], wrapped[key]
        record[ratio] = wrapped_peak / plain_peak if plain_peak and wrapped_peak else None
    del sides, wrapped_model
    if on_cuda:
        gc.collect()
        torch.cuda.empty_cache()
    return record
