"""One step simulator: the estimate the planner decides with and the checker reports.

Pure: ops in, estimated times out; no torch, no device. Both users build a list of
:class:`SimOp` and call :func:`simulate`:

* the race checker from the ops it recorded (``testing._timeline.lay_out``);
* the planner from one observed forward and a stage placement (:func:`step_ops`), the
  backward modelled from that forward.

The model, in estimated µs on a named reference GPU (never a measurement):

1. **The host issues ops one at a time, in program order.** Before issuing an op it spends
   the op's ``host_us`` (``launch_us`` per kernel; half of ``fork_join_us`` per event
   wait, an event record and a wait); an op can start only once issued. A ``sync`` op (a
   host read) blocks the host until it is done.
2. **Streams run their ops in order**, each op after the previous one on its stream and
   after every op in its ``waits`` (events recorded on other streams).
3. **Concurrent kernels share the GPU by occupancy** (processor sharing). An op's device
   time is its ``floor_us`` (launch latency and tail, which takes no SMs) plus its work;
   while the running kernels' occupancies sum to at most 1 each runs its work at full
   speed, beyond that each runs at ``1 / sum`` of it. Two kernels that each fill the GPU
   take as long side by side as one after the other.

The planner's backward (:func:`step_ops`) is the observed forward reversed: the autograd
engine runs one host thread per device and, among ready nodes, the one created last, so
it issues the nodes in reverse creation order; each forward kernel's backward runs on the
stream of its forward and costs what :func:`backward_cost` says for the op (about
``BACKWARD_FACTOR`` times its device time, in ``BACKWARD_LAUNCHES`` kernels, unless the op
is listed); a gradient crossing streams is an event wait. Every stage
call costs a fork and a join each way (forward, and its backward's wait back). The loss
is two small kernels after the forward (a reduction and its gradient's seed); the step
ends with an optimizer update per parameter on the caller's stream (an SGD ``add_``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._plan import StepEstimate

if TYPE_CHECKING:
    from .cost import ReferenceGPU
    from .observe import CallRecord, ObservedOp

__all__ = [
    "BACKWARD_FACTOR",
    "BACKWARD_LAUNCHES",
    "SimOp",
    "SimResult",
    "backward_cost",
    "estimate_step",
    "simulate",
    "step_ops",
]

# The backward of a forward kernel, as (times its device time, kernels), by the op's name:
# a matmul's is two matmuls (and a bias reduction for ``addmm``), a convolution's one
# ``convolution_backward``; an in-place op (a running-statistics update) and a
# concatenation (its backward is views) launch none; any other op about one kernel a bit
# slower than its forward. An estimate, like the costs it scales. Each listed op has two:
# its usual backward, and the one of a matmul or convolution of the step's inputs (the
# first layer), which needs no input gradient.
BACKWARD_FACTOR = 1.15
BACKWARD_LAUNCHES = 1.0
_BACKWARD: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "addmm": ((2.05, 3.0), (1.05, 2.0)),
    "mm": ((2.0, 2.0), (1.0, 1.0)),
    "bmm": ((2.0, 2.0), (1.0, 1.0)),
    "baddbmm": ((2.05, 3.0), (1.05, 2.0)),
    "convolution": ((1.35, 1.0), (0.7, 1.0)),
    "cat": ((0.0, 0.0), (0.0, 0.0)),
    "stack": ((0.0, 0.0), (0.0, 0.0)),
}


def backward_cost(name: str, first: bool = False) -> tuple[float, float]:
    """(device-time factor, kernels) of the backward of the forward op ``name``
    (``aten.addmm.default``); ``first``: it reads nothing another op of the forward made
    (only inputs and parameters), so a matmul's input gradient is not computed."""
    packet = name.split(".")[1] if name.startswith("aten.") else name
    if packet in _BACKWARD:
        usual, first_layer = _BACKWARD[packet]
        return first_layer if first else usual
    if packet.endswith("_") and not packet.startswith("_"):
        return (0.0, 0.0)
    return (BACKWARD_FACTOR, BACKWARD_LAUNCHES)


_EPS = 1e-9


@dataclass(frozen=True)
class SimOp:
    """One op for :func:`simulate` (see the module docstring for the model).

    Attributes:
        stream: the stream it runs on (any int; the caller's stream is usually 0).
        device_us: estimated device time alone on the GPU; 0 for no kernel.
        occupancy: the fraction of the GPU its kernel fills, in (0, 1].
        waits: indices of earlier ops its stream waits for before it.
        host_us: host time spent just before issuing it.
        sync: whether the host waits for it to finish.
        floor_us: the part of ``device_us`` that occupies no SM (latency, tail).
    """

    stream: int
    device_us: float
    occupancy: float = 1.0
    waits: tuple[int, ...] = ()
    host_us: float = 0.0
    sync: bool = False
    floor_us: float = 0.0


@dataclass(frozen=True)
class SimResult:
    """Per op its start and end, and the step's length (to the last op or host sync)."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    length_us: float


def simulate(ops: Sequence[SimOp], *, share: bool = True) -> SimResult:
    """Run ``ops`` on the model of the module docstring; waits on unknown indices are met.

    ``share=False``: concurrent kernels never slow each other (an upper bound on overlap,
    for tests of plan structure on models whose kernels fill the GPU).
    """
    for op in ops:
        if not all(map(math.isfinite, (op.device_us, op.host_us, op.floor_us, op.occupancy))):
            raise ValueError(f"a simulated op needs finite costs, got {op}")
    n = len(ops)
    starts = [0.0] * n
    ends: list[float | None] = [None] * n
    queues: dict[int, list[int]] = {}  # stream -> issued ops not started, in order
    heads: dict[int, int] = {}  # stream -> position of its next op in its queue
    busy: dict[int, int] = {}  # stream -> the op running on it
    work: dict[int, float] = {}  # running op -> work left (µs at full speed)
    tail: dict[int, float] = {}  # running op -> floor left once its work is done
    now = 0.0
    host = 0.0  # when the host is free to issue
    issued = 0
    blocked: int | None = None  # the sync op the host waits for

    def met(index: int) -> bool:
        return all(not 0 <= w < n or ends[w] is not None for w in ops[index].waits)

    def start_ready() -> None:
        progress = True
        while progress:
            progress = False
            for stream, queue in queues.items():
                head = heads[stream]
                if stream in busy or head >= len(queue) or not met(queue[head]):
                    continue
                index = queue[head]
                heads[stream] = head + 1
                op = ops[index]
                starts[index] = now
                if op.device_us <= 0:
                    ends[index] = now
                else:
                    floor = min(max(op.floor_us, 0.0), op.device_us)
                    busy[stream] = index
                    work[index] = op.device_us - floor
                    tail[index] = floor
                progress = True

    while True:
        while blocked is None and issued < n and host + ops[issued].host_us <= now + _EPS:
            op = ops[issued]
            host += max(op.host_us, 0.0)
            queues.setdefault(op.stream, []).append(issued)
            heads.setdefault(op.stream, 0)
            if op.sync:
                blocked = issued
            issued += 1
        start_ready()
        if blocked is not None and ends[blocked] is not None:
            host = max(host, ends[blocked] or 0.0)
            blocked = None
            continue
        sharing = [i for i in busy.values() if work[i] > _EPS]
        total = sum(min(max(ops[i].occupancy, _EPS), 1.0) for i in sharing)
        rate = 1.0 if total <= 1.0 or not share else 1.0 / total
        # Time to the next event, as a duration (not an absolute time: far into a long
        # step, now + a tiny duration rounds back to now and nothing would advance).
        step = {i: work[i] / rate if work[i] > _EPS else tail[i] for i in busy.values()}
        durations = list(step.values())
        if blocked is None and issued < n:
            durations.append(max(host + ops[issued].host_us - now, 0.0))
        if not durations:
            break
        elapsed = min(durations)
        now += elapsed
        for stream, index in list(busy.items()):
            finished = step[index] <= elapsed  # the op (or ops) the next event belongs to
            if work[index] > _EPS:
                work[index] = 0.0 if finished else work[index] - elapsed * rate
            else:
                tail[index] = 0.0 if finished else tail[index] - elapsed
            if work[index] <= _EPS and tail[index] <= _EPS:
                ends[index] = now
                del busy[stream], work[index], tail[index]
    done = [e if e is not None else now for e in ends]
    length = max([host, *done], default=0.0)
    return SimResult(tuple(starts), tuple(done), length)


def step_ops(
    record: CallRecord,
    stage_stream: Mapping[int, int],
    gpu: ReferenceGPU,
    *,
    one_stream: bool = False,
) -> list[SimOp]:
    """The ops of one training step of ``record`` with ``stage_stream`` placing stage calls.

    ``stage_stream`` maps the ``call_id`` of each stage call to its side stream (``0..``);
    every other op runs on the caller's stream. The forward joins each stage before the
    caller goes on; the backward is the forward reversed (module docstring).
    ``one_stream``: the same ops on one stream, with no fork, join or wait.
    """
    from .cost import ELEMENTS_PER_BLOCK
    from .observe import CallRecord as Call

    ops: list[SimOp] = []
    fwd: list[tuple[int, int, ObservedOp]] = []  # (sim index, stream, forward ObservedOp)
    last: dict[int, int] = {}  # stream -> its last op's index
    half = gpu.fork_join_us / 2
    floor = gpu.kernel_floor_us

    def add(op: SimOp) -> int:
        ops.append(op)
        last[op.stream] = len(ops) - 1
        return len(ops) - 1

    def visit(call: Call, stream: int) -> None:
        for item in call.items:
            if isinstance(item, Call):
                side = stage_stream.get(item.call_id)
                if side is None or one_stream or stream != 0:
                    visit(item, stream)
                    continue
                target = side + 1
                caller_last = last.get(0)
                first = len(ops)
                visit(item, target)
                if len(ops) == first:
                    continue
                if caller_last is not None:  # the fork: the stage's stream waits for ours
                    head = ops[first]
                    ops[first] = SimOp(
                        head.stream,
                        head.device_us,
                        head.occupancy,
                        (*head.waits, caller_last),
                        head.host_us + half,
                        head.sync,
                        head.floor_us,
                    )
                add(SimOp(0, 0.0, waits=(last[target],), host_us=half))  # the join
                continue
            launches = item.device_us > 0
            index = add(
                SimOp(
                    stream,
                    item.device_us,
                    item.occupancy,
                    host_us=gpu.launch_us if launches else 0.0,
                    floor_us=min(floor, item.device_us),
                )
            )
            if launches:
                fwd.append((index, stream, item))

    visit(record, 0)
    for _ in range(2):  # the loss (a reduction of the output) and its gradient's seed
        add(SimOp(0, floor, 1 / gpu.sm_count, host_us=gpu.launch_us, floor_us=floor))
    # Backward: the forward kernels in reverse order, each after its consumers' backward.
    producer: dict[int, int] = {}  # storage -> position in ``fwd`` of its last writer
    consumers: list[list[int]] = [[] for _ in fwd]
    first: list[bool] = []
    for position, (_, _, op) in enumerate(fwd):
        first.append(not any(key in producer for key in op.reads))
        for key in op.reads:
            if key in producer:
                consumers[producer[key]].append(position)
        for key in (*op.writes, *op.fresh):
            producer[key] = position
    back: dict[int, int] = {}  # forward position -> its backward op's index
    streams_used: set[int] = set()
    for position in range(len(fwd) - 1, -1, -1):
        _, stream, op = fwd[position]
        factor, launches = backward_cost(op.name, first[position])
        device = op.device_us * factor
        waits = tuple(
            sorted(
                {
                    back[c]
                    for c in consumers[position]
                    if c in back and ops[back[c]].stream != stream
                }
            )
        )
        back[position] = add(
            SimOp(
                stream,
                device,
                op.occupancy,
                waits,
                gpu.launch_us * launches + half * len(waits),
                floor_us=min(floor, device),
            )
        )
        streams_used.add(stream)
    sides = sorted(s for s in streams_used if s != 0)
    if sides:  # the caller's stream waits for every side stream at the end of backward
        waits = tuple(last[s] for s in sides)
        add(SimOp(0, 0.0, waits=waits, host_us=half * len(waits)))
    # The optimizer step on the caller's stream: one update per parameter, reading it and
    # its gradient and writing it back.
    for call in record.calls():
        for numel, size in call.params:
            blocks = max(1, -(-numel // ELEMENTS_PER_BLOCK))
            occupancy = min(1.0, blocks / gpu.sm_count)
            device = 3 * numel * size / (gpu.memory_bandwidth * occupancy) * 1e6 + floor
            add(SimOp(0, device, occupancy, host_us=gpu.launch_us, floor_us=floor))
    return ops


def estimate_step(
    record: CallRecord, stage_stream: Mapping[int, int], gpu: ReferenceGPU, *, share: bool = True
) -> StepEstimate:
    """The simulated step of ``record`` with ``stage_stream`` against one stream."""
    wrapped = simulate(step_ops(record, stage_stream, gpu), share=share).length_us
    serial = simulate(step_ops(record, {}, gpu, one_stream=True), share=share).length_us
    return StepEstimate(wrapped, serial, gpu.name)
