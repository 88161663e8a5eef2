"""Measure one benchmark point: plain vs wrapped (and other modes), same model, shapes, seed.

For one :class:`Point` (model spec, batch size, precision) on one device, every mode in
``modes`` (see :data:`MODES`; plain and wrapped eager always) is one side:

1. One reference model is built from a fixed random seed; each side is a deep copy of it, so
   every side starts from identical parameters. Inputs and targets are made once and
   shared by all sides.
2. Memory phase, each side alone: the peak device memory (allocated, and reserved by the
   caching allocator) of a few steps of that side (``reset_peak_memory_stats`` first, the
   memory already held before the side was built subtracted). These are also each side's
   first steps, reported as such. A graphed side is captured here (and its graph's pool
   counted), then replayed.
3. Timing phase, all sides resident: steps interleaved plain, wrapped, (the other modes),
   plain, wrapped... so that clock and thermal drift hit all alike. Every step is
   synchronized before and after, so a step's time is what the caller waits for: eager,
   zero_grad, forward (under autocast for bfloat16), loss, backward, optimizer step;
   graphed, the copy of the batch into the graph's static inputs and one replay of the
   whole captured step. The first ``warmup`` steps of each side are reported apart from
   the ``steps`` steady-state ones.

A graphed side is the library's own recipe, :func:`ooo_wrap.graphed_step`: the step
(zero_grad, forward, loss, backward, optimizer step) runs ``graph_warmup`` eager steps on
a side stream, then is captured, so its parameters are that many steps ahead of the eager
sides' and its losses are not comparable with theirs. The suite times the warm-up and the
capture apart (``graph_warmup_ms``, ``capture_ms``), and reads the wrapper's counters
around the captured step alone: ``capture_stage_calls`` (stage calls forked onto side
streams inside the capture) and ``capture_bypasses`` (stage calls run inline, whatever
the reason), from which ``wrapper_in_capture`` says where the stages ran. Under bfloat16
the captured step runs autocast with its weight-cast cache off
(``cache_enabled=False``, as PyTorch's CUDA graph notes ask of captured autocast
regions): a cached cast made during capture would outlive it. A step that is not
captured (``GraphedStep.captured`` false: no CUDA) is a failed mode with the step's
message, never timed as graphed. A mode other than plain and wrapped eager that fails
(a capture that raised, say) is recorded as failed with its error in ``failed_modes``,
or listed in ``out_of_memory_modes`` when it ran out of device memory (also inside the
capture, where ``graphed_step`` keeps the error as the cause of its ``OOOError``); the
other sides are still measured.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch
from torch import nn

import ooo_wrap

from .models import ModelSpec

__all__ = [
    "DTYPES",
    "GRAPHED_MODES",
    "MODES",
    "Dtype",
    "Mode",
    "Point",
    "measure_point",
    "summarize_times",
]

Dtype = Literal["float32", "bfloat16"]
DTYPES: tuple[Dtype, ...] = ("float32", "bfloat16")
_AUTOCAST: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}

Mode = Literal[
    "plain",
    "wrapped",
    "wrapped_overlap",
    "wrapped_tuned",
    "wrapped_split",
    "plain_graphed",
    "wrapped_graphed",
]
# In this order (the Literal's) each point measures them, and each timing round steps them.
MODES: tuple[Mode, ...] = get_args(Mode)
REQUIRED_MODES: tuple[Mode, ...] = ("plain", "wrapped")  # every other mode is compared to them
GRAPHED_MODES: tuple[Mode, ...] = ("plain_graphed", "wrapped_graphed")
WRAPPED_MODES: tuple[Mode, ...] = (
    "wrapped",
    "wrapped_overlap",
    "wrapped_tuned",
    "wrapped_split",
    "wrapped_graphed",
)
MODE_DESCRIPTIONS: dict[Mode, str] = {
    "plain": "the model as it is, eager",
    "wrapped": "OOOModule(tune=False), eager: the plan itself, never dropped",
    "wrapped_overlap": "OOOModule(overlap_forward=True, tune=False), eager",
    "wrapped_tuned": "OOOModule(tune='auto'), eager: the wrapper times plain against planned "
    "steps and keeps the faster; each point records its decision and both medians beside "
    "this mode's own interleaved times",
    "wrapped_split": "OOOModule(split_weight_grads=True, tune=False), eager: the plan with "
    "every Linear and Conv weight gradient on a weight-gradient stream; each point records "
    "the split layer calls per step",
    "plain_graphed": "the model as it is, the whole step captured as one CUDA graph, replayed",
    "wrapped_graphed": "OOOModule, the whole step captured as one CUDA graph, replayed; "
    "each point records the wrapper's stage calls forked onto side streams and run inline "
    "during the capture (from its stats)",
}

# capture(step_fn, *sample_args, warmup=...) -> a GraphedStep-like object (``captured``,
# ``reason``, ``message``; calling it copies its arguments in and replays);
# ``ooo_wrap.graphed_step`` by default.
Capture = Callable[..., Any]
# The wrapper's counters read around the captured step (``OOOStats`` fields).
CAPTURE_STATS = ("stage_calls", "bypasses")


class NotCapturedError(RuntimeError):
    """The graphed mode's step was not captured (it would run eagerly): a failed mode."""


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


def check_modes(modes: Sequence[str]) -> tuple[Mode, ...]:
    """``modes`` in :data:`MODES` order, without repeats; plain and wrapped must be there."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {', '.join(unknown)}; choose from {', '.join(MODES)}")
    missing = [m for m in REQUIRED_MODES if m not in modes]
    if missing:
        raise ValueError(
            f"modes must include {' and '.join(REQUIRED_MODES)} (every other mode is compared "
            f"with them); add {', '.join(missing)}"
        )
    return tuple(m for m in MODES if m in modes)


class _Side:
    """One side of the comparison: a model copy, its optimizer, and how to train one step."""

    def __init__(self, mode: Mode, model: nn.Module, lr: float) -> None:
        self.name: Mode = mode
        self.model = model
        # Momentum gives the optimizer per-parameter state, as real training has.
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.capture_ms: float | None = None  # a graphed side's capture, from here on
        self.graph_warmup_ms: float | None = None
        self.capture_stats: dict[str, int] | None = None  # counter deltas of the capture

    def body(
        self,
        spec: ModelSpec,
        inputs: torch.Tensor,
        target: torch.Tensor,
        dtype: Dtype,
        *,
        autocast_cache: bool = True,
    ) -> torch.Tensor:
        """Forward (autocast for bfloat16), loss, backward, optimizer step; no zero_grad."""
        autocast_dtype = _AUTOCAST[dtype]
        precision = (
            torch.autocast(inputs.device.type, dtype=autocast_dtype, cache_enabled=autocast_cache)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with precision:
            output = self.model(inputs)
        loss = spec.loss(output, target)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(
        self, spec: ModelSpec, batch: tuple[torch.Tensor, torch.Tensor], dtype: Dtype
    ) -> torch.Tensor:
        self.zero_grad()
        return self.body(spec, *batch, dtype)


class _GraphedSide(_Side):
    """A side whose whole training step is captured once and replayed."""

    def __init__(
        self,
        mode: Mode,
        model: nn.Module,
        lr: float,
        *,
        spec: ModelSpec,
        batch: tuple[torch.Tensor, torch.Tensor],
        dtype: Dtype,
        capture: Capture,
        warmup: int,
        sync: Callable[[], None],
    ) -> None:
        super().__init__(mode, model, lr)
        # Per call of step_fn: when it started, and the wrapper's counters then.
        calls: list[tuple[float, dict[str, int] | None]] = []

        def step_fn(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            calls.append((time.perf_counter(), _stats(self.model)))
            self.zero_grad()  # set to None: the capture allocates the gradients it rewrites
            # Autocast's cast cache would keep tensors made during capture past it.
            return self.body(spec, inputs, target, dtype, autocast_cache=False)

        sync()
        start = time.perf_counter()
        graphed = capture(step_fn, *batch, warmup=warmup)
        sync()
        end = time.perf_counter()
        if not graphed.captured:
            raise NotCapturedError(f"{graphed.message} (reason: {graphed.reason})")
        if len(calls) != warmup + 1:
            raise RuntimeError(
                f"the capture ran the step {len(calls)} times, expected {warmup} warm-up "
                "steps and the captured one"
            )
        # The captured step is the last call. graphed_step's warm-up has finished on the
        # device when it starts (torch.cuda.graph synchronizes before capturing), so the
        # capture's time runs from there to the instantiated graph.
        captured_at, before = calls[-1]
        self.graph_warmup_ms = (captured_at - start) * 1e3
        self.capture_ms = (end - captured_at) * 1e3
        after = _stats(model)
        if before is not None and after is not None:
            self.capture_stats = {key: after[key] - before[key] for key in CAPTURE_STATS}
        self._replay = graphed

    def step(
        self, spec: ModelSpec, batch: tuple[torch.Tensor, torch.Tensor], dtype: Dtype
    ) -> torch.Tensor:
        loss: torch.Tensor = self._replay(*batch)
        return loss


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


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _out_of_memory(error: BaseException) -> bool:
    """``error`` is, or was raised from, running out of device memory: ``graphed_step``
    raises ``OOOError`` from a ``torch.OutOfMemoryError`` inside the capture."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, torch.OutOfMemoryError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


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
    modes: Sequence[str] = REQUIRED_MODES,
    capture: Capture | None = None,
    graph_warmup: int = 3,
) -> dict[str, Any]:
    """Measure ``point`` on ``device``; returns the JSON-ready record of every side.

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
        modes: the sides, from :data:`MODES`; plain and wrapped eager are required.
            ``wrapped_overlap`` wraps with ``overlap_forward=True``, ``wrapped_split``
            with ``split_weight_grads=True``; the graphed modes
            capture the whole step with ``capture``.
        capture: how a graphed side captures its step (:func:`ooo_wrap.graphed_step` by
            default: without CUDA it does not capture, and the graphed modes fail).
        graph_warmup: eager steps of a graphed side before its capture (``graphed_step``
            needs at least 2).

    Returns:
        One dict per measured mode under its name (``plain``, ``wrapped``, ...), and
        ``modes`` (asked for), ``failed_modes`` (mode: error), ``out_of_memory_modes``,
        ``speedup`` (plain / wrapped eager), ``speedups`` (plain eager / each mode),
        ``graphed_speedup`` (plain graphed / wrapped graphed, or ``None``), memory ratios.
    """
    if steps < 1 or warmup < 0 or mem_steps < 1:
        raise ValueError("need steps >= 1, warmup >= 0 and mem_steps >= 1")
    wanted = check_modes(modes)
    capture_fn: Capture = capture if capture is not None else ooo_wrap.graphed_step
    spec = point.spec
    sync = _synchronizer(device)
    on_cuda = device.type == "cuda"
    with torch.device(device):  # initialise on the device: large models build much faster
        reference = spec.build(seed)
    batch = spec.make_batch(point.batch, device, seed)

    def make_side(mode: Mode, reference: nn.Module) -> _Side:
        model = copy.deepcopy(reference)
        if mode in WRAPPED_MODES:
            model = ooo_wrap.OOOModule(
                model,
                streams=streams,
                backend=backend,
                planner=planner,  # type: ignore[arg-type]
                overlap_forward=mode == "wrapped_overlap",
                tune="auto" if mode == "wrapped_tuned" else False,
                split_weight_grads=True if mode == "wrapped_split" else "auto",
            )
        if mode in GRAPHED_MODES:
            return _GraphedSide(
                mode,
                model,
                lr,
                spec=spec,
                batch=batch,
                dtype=point.dtype,
                capture=capture_fn,
                warmup=graph_warmup,
                sync=sync,
            )
        return _Side(mode, model, lr)

    record: dict[str, Any] = {
        "model": spec.family,
        "label": spec.label,
        "size": spec.size,
        "batch": point.batch,
        "dtype": point.dtype,
        "planner": planner,
        "modes": list(wanted),
        "failed_modes": {},
        "out_of_memory_modes": [],
    }

    def fail(mode: Mode, error: Exception) -> None:
        """An optional mode's failure is recorded; plain or wrapped failing fails the point."""
        if mode in REQUIRED_MODES:
            raise error
        if _out_of_memory(error):
            record["out_of_memory_modes"].append(mode)
        else:
            record["failed_modes"][mode] = _failure(error)
        record.pop(mode, None)
        _release(on_cuda)

    # Memory phase: each side alone on the device (besides the reference and the batch).
    measured: list[Mode] = []
    for mode in wanted:
        sync()
        base = base_reserved = 0
        if on_cuda:  # free what earlier points left, so that it is not counted (or held)
            gc.collect()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            base_reserved = torch.cuda.memory_reserved(device)
            torch.cuda.reset_peak_memory_stats(device)
        try:
            side = make_side(mode, reference)
            first: list[float] = []
            for _ in range(mem_steps):
                sync()
                start = time.perf_counter()
                side.step(spec, batch, point.dtype)
                sync()
                first.append(time.perf_counter() - start)
        except Exception as error:
            fail(mode, error)
            continue
        record[mode] = {"first_steps_ms": [s * 1e3 for s in first]}
        if side.capture_ms is not None:
            record[mode]["capture_ms"] = side.capture_ms
            record[mode]["graph_warmup_ms"] = side.graph_warmup_ms
        # Allocated is what tensors use; reserved adds what the caching allocator holds,
        # which side streams can raise (a freed block is reused only on its own stream).
        record[mode]["peak_memory_bytes"] = (
            torch.cuda.max_memory_allocated(device) - base if on_cuda else None
        )
        record[mode]["peak_reserved_bytes"] = (
            torch.cuda.max_memory_reserved(device) - base_reserved if on_cuda else None
        )
        measured.append(mode)
        del side

    # Timing phase: all sides resident, steps interleaved A/B/C/A/B/C.
    sides: list[_Side] = []
    for mode in measured:
        try:
            sides.append(make_side(mode, reference))
        except Exception as error:
            fail(mode, error)
    del reference  # the sides' copies on the device from here on, not one more
    for side in sides:
        if side.name == "wrapped_tuned":
            # Interleaved, the time between two of its timing marks would include the
            # other sides' steps: it tunes alone first, then is timed with the others.
            record[side.name]["tuning_steps"] = _tune_alone(side, spec, batch, point.dtype, sync)
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    losses: dict[str, torch.Tensor] = {}
    stats_before = {side.name: _stats(side.model) for side in sides}
    for i in range(warmup + steps):
        if i == warmup:
            stats_before = {side.name: _stats(side.model) for side in sides}
        for side in list(sides):
            sync()
            start = time.perf_counter()
            try:
                losses[side.name] = side.step(spec, batch, point.dtype)
                sync()
            except Exception as error:
                fail(side.name, error)
                sides.remove(side)
                continue
            times[side.name].append(time.perf_counter() - start)

    for side in sides:
        name = side.name
        entry = record[name]
        entry.update(summarize_times(times[name][warmup:], point.batch))
        entry["warmup_ms"] = [s * 1e3 for s in times[name][:warmup]]
        entry["final_loss"] = float(losses[name])
        if name in GRAPHED_MODES:
            entry["captured"] = True
            entry["capture_ms"] = side.capture_ms  # the timing phase's capture
            entry["graph_warmup_ms"] = side.graph_warmup_ms
        if name in WRAPPED_MODES:
            _wrapper_fields(entry, side, stats_before[name], steps)

    plain_ms = record["plain"]["median_ms"]
    record["speedup"] = plain_ms / record["wrapped"]["median_ms"]
    record["speedups"] = {
        s.name: plain_ms / record[s.name]["median_ms"] for s in sides if s.name != "plain"
    }
    graphed = [record.get(mode, {}).get("median_ms") for mode in GRAPHED_MODES]
    record["graphed_speedup"] = graphed[0] / graphed[1] if None not in graphed else None
    for key, ratio in (
        ("peak_memory_bytes", "memory_ratio"),
        ("peak_reserved_bytes", "reserved_ratio"),
    ):
        plain_peak, wrapped_peak = record["plain"][key], record["wrapped"][key]
        record[ratio] = wrapped_peak / plain_peak if plain_peak and wrapped_peak else None
    del sides
    _release(on_cuda)
    return record


def _wrapper_fields(
    entry: dict[str, Any], side: _Side, before: dict[str, int] | None, steps: int
) -> None:
    """What the wrapper did on a wrapped side: active, events, plan, stats or capture."""
    model = side.model
    after = _stats(model)
    entry["active"] = after is not None
    entry["events"] = [str(event) for event in ooo_wrap.events_for(model)]
    if not isinstance(model, ooo_wrap.OOOModule) or after is None:
        return
    entry["stages"] = len(model.plan.stages)
    entry["streams"] = model.plan.num_streams
    if side.name == "wrapped_tuned":
        entry["tuning"] = _tuning_fields(model.tuning)
    if side.name not in GRAPHED_MODES:
        assert before is not None
        entry["stats_per_step"] = {key: (after[key] - before[key]) / steps for key in after}
        return
    # A replay runs no Python: the hooks ran during warm-up and capture only. The counters
    # read around the captured step say whether its stage calls forked onto side streams
    # inside the capture (stage_calls) or ran inline on the capturing stream (bypasses).
    counts = side.capture_stats or dict.fromkeys(CAPTURE_STATS, 0)
    forked, inline = counts["stage_calls"], counts["bypasses"]
    entry["capture_stage_calls"] = forked
    entry["capture_bypasses"] = inline
    entry["wrapper_in_capture"] = _where_in_capture(entry["stages"], forked, inline)


def _tune_alone(
    side: _Side, spec: ModelSpec, batch: Any, dtype: Dtype, sync: Callable[[], None]
) -> int:
    """Step ``side`` alone until its tuning decides (or it cannot tune); the steps taken."""
    model = side.model
    for taken in range(_MAX_TUNING_STEPS):
        tuning = model.tuning if isinstance(model, ooo_wrap.OOOModule) else None
        if tuning is None:  # it cannot tune (or, before the first step, has not begun)
            if taken > 0:
                return taken
        elif tuning.decision != "pending":
            return taken
        side.step(spec, batch, dtype)
        sync()
    return _MAX_TUNING_STEPS


# Past every tuning's cap (learning forward, warm-ups, three rounds of pairs, skips).
_MAX_TUNING_STEPS = 100


def _tuning_fields(tuning: ooo_wrap.Tuning | None) -> dict[str, Any] | None:
    """The wrapper's own measurement: ``None`` where its backend cannot time steps."""
    if tuning is None:
        return None
    return {
        "decision": tuning.decision,
        "device": tuning.device,
        "speedup": tuning.speedup,
        "why": tuning.why,
        "arms": {
            # Beside each arm's measured steps, the simulator's estimate (reference GPU).
            arm.name: {
                "median_ms": arm.median_ms,
                "step_ms": list(arm.step_ms),
                "estimate_us": arm.estimate_us,
            }
            for arm in tuning.arms
        },
    }


def _where_in_capture(stages: int, forked: int, inline: int) -> str:
    """Where the wrapper ran the captured step's stage calls, from its counters."""
    if not stages:
        return "no stages"
    if forked and inline:
        return "partly inline"
    if inline:
        return "inline"
    return "side streams" if forked else "no stage calls"


def _release(on_cuda: bool) -> None:
    if on_cuda:  # give back what a side held before the next one is measured
        gc.collect()
        torch.cuda.empty_cache()
