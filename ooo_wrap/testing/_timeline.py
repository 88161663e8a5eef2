"""The checker's ops on an estimated time axis: what the trace draws and the step estimate.

Each recorded op carries its estimated device time and occupancy (``ooo_wrap._planner.cost``, on a
named reference GPU) and its stream's vector clock. They are laid out by the step
simulator the planner uses too (``ooo_wrap._planner.simulate``), so a plan's estimate and the
checker's speak of the same step:

1. The host issues ops one at a time in the order they were recorded; each kernel costs
   it ``launch_us`` and can start only once issued.
2. An op starts after the previous op on its stream, and after every op its clock says it
   waits for (an event recorded on another stream and waited on here, by the scheduler
   or by the autograd engine): the waits are the clock's new entries since the previous
   op on the stream. Each wait costs the host half of ``fork_join_us`` (an event record
   and a wait).
3. A host sync (``.item()``, :func:`host_read`) blocks the host until the op is done.
4. Concurrent kernels share the GPU by occupancy: while their occupancies sum to at most
   1 they run at full speed, beyond that each slows in proportion (the kernel floor, a
   latency, is not shared).

The same ops laid out on one stream (every op after the previous one, no waits, no
fork/join cost) give the baseline the report compares against. ``graphed=True`` lays them
out as a CUDA graph replays them: no launch or event costs the host anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._planner.cost import H200, ReferenceGPU
from .._planner.simulate import SimOp, simulate
from ._ops import always_syncs
from ._tracker import OpRecord

__all__ = ["Slot", "Timeline", "lay_out", "split_steps"]


@dataclass(frozen=True)
class Slot:
    """One op placed on the time axis, in estimated µs from the start."""

    record: OpRecord
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Ops laid out in time, the waits between them, and the span they take.

    Attributes:
        slots: one per record, in record order.
        waits: ``(producer seq, consumer seq)``: the consumer's stream waited for the
            producer (only waits that the ops' clocks show and no other wait implies).
        length_us: from the first issue to the end of the last op or host sync.
        gpu: the reference GPU the costs were estimated on.
    """

    slots: tuple[Slot, ...]
    waits: tuple[tuple[int, int], ...]
    length_us: float
    gpu: ReferenceGPU


def lay_out(
    records: Sequence[OpRecord],
    *,
    one_stream: bool = False,
    gpu: ReferenceGPU = H200,
    graphed: bool = False,
) -> Timeline:
    """Place ``records`` on the estimated time axis (see the module docstring).

    Args:
        records: recorded ops in their host order; waits on ops outside them count as met.
        one_stream: lay the same ops out on a single stream instead.
        gpu: whose host costs (launch, fork/join) apply; the ops' device costs were
            estimated when they were recorded.
        graphed: as a CUDA graph replay: no host cost per launch or event wait.
    """
    launch = 0.0 if graphed else gpu.launch_us
    half = 0.0 if graphed else gpu.fork_join_us / 2
    record_of: dict[tuple[int, int], OpRecord] = {}
    index_of: dict[int, int] = {}  # seq -> position in ``records``
    last_clock: dict[int, dict[int, int]] = {}
    ops: list[SimOp] = []
    waits: list[tuple[int, int]] = []
    for position, record in enumerate(records):
        own = record.stream_index
        clock = dict(record.clock)
        host = launch if record.cost_us > 0 else 0.0
        sources: list[int] = []
        if not one_stream:
            for source in _direct_waits(clock, last_clock.get(own, {}), own, record_of):
                waits.append((source.seq, record.seq))
                sources.append(index_of[source.seq])
                host += half
            last_clock[own] = clock
        floor = min(gpu.kernel_floor_us, record.cost_us)
        ops.append(
            SimOp(
                0 if one_stream else own,
                record.cost_us,
                record.occupancy,
                tuple(sources),
                host,
                always_syncs(record.op),
                floor,
            )
        )
        if own in clock:
            record_of[(own, clock[own])] = record
        index_of[record.seq] = position
    result = simulate(ops)
    slots = tuple(
        Slot(record, start, end)
        for record, start, end in zip(records, result.starts, result.ends, strict=True)
    )
    return Timeline(slots, tuple(waits), result.length_us, gpu)


def _direct_waits(
    clock: dict[int, int],
    before: dict[int, int],
    own: int,
    record_of: dict[tuple[int, int], OpRecord],
) -> list[OpRecord]:
    """The ops this op's stream newly waited for, less those another new wait implies."""
    new = {s: n for s, n in clock.items() if s != own and n > before.get(s, 0)}
    direct = []
    for stream, count in new.items():
        implied = False
        for other, other_count in new.items():
            source = record_of.get((other, other_count))
            if other != stream and source is not None:
                implied = implied or dict(source.clock).get(stream, 0) >= count
        if not implied and (stream, count) in record_of:
            direct.append(record_of[(stream, count)])
    return direct


def split_steps(records: Sequence[OpRecord]) -> list[list[OpRecord]]:
    """The records of each training step: a step starts at a forward op after another phase."""
    steps: list[list[OpRecord]] = []
    previous = None
    for record in records:
        if not steps or (record.phase == "forward" and previous != "forward"):
            steps.append([])
        steps[-1].append(record)
        previous = record.phase
    return steps
