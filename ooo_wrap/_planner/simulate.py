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
stream of its forward and costs what ``backward.backward_cost`` says for the op (about
``BACKWARD_FACTOR`` times its device time, in ``BACKWARD_LAUNCHES`` kernels, unless the op
is listed); a gradient crossing streams is an event wait. Every stage
call costs a fork and a join each way (forward, and its backward's wait back). The loss
is two small kernels after the forward (a reduction and its gradient's seed); the step
ends with an optimizer update per parameter on the caller's stream (an SGD ``add_``).

Two switches price other ways of running the same step:

* **The weight-gradient split** (``split=True``). A matmul or convolution that is a
  layer's own op (an op of a module call with parameters: ``nn.Linear``, ``nn.ConvNd``)
  runs its backward as two kernels (``backward.split_cost``): the input gradient (dI) on
  the layer's stream, and the weight gradient (dW, with the bias's) on the one
  weight-gradient stream, which first waits on an event recorded once the output gradient
  is ready (a fork: half a ``fork_join_us`` of host time), so dW runs beside the next
  layer's dI, sharing the GPU by occupancy. The layer's stream waits on the dW of the
  split layer ``SPLIT_LAG`` layers back; the caller's stream waits on the weight-gradient
  stream at the end of backward. Each split layer call adds the split's host cost
  (``backward.split_host_us``, measured on the CPU and scaled to the reference GPU's
  launches), half in forward, half in backward.
* **A CUDA graph replay** (``graphed=True``: a step captured with ``graphed_step`` or
  ``make_graphed_callables``). The replay is one launch; then no kernel costs the host a
  launch, an event fork or join is a graph edge (the dependency, no host time), and the
  split costs no host time (its Python does not run on replay). Plain is priced as a
  replay too: both arms replay a graph.

:func:`estimate_arm` is the one entry that prices a candidate against the plain model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .._plan import StepEstimate
from .backward import (
    BACKWARD_FACTOR,
    BACKWARD_LAUNCHES,
    SPLIT_LAG,
    backward_cost,
    split_cost,
    split_host_us,
    splits,
)

if TYPE_CHECKING:
    from .cost import ReferenceGPU
    from .observe import CallRecord, ObservedOp

__all__ = [
    "BACKWARD_FACTOR",
    "BACKWARD_LAUNCHES",
    "SimOp",
    "SimResult",
    "backward_cost",
    "estimate_arm",
    "simulate",
    "step_ops",
]

_EPS = 1e-9
_WGRAD = -1  # the weight-gradient stream (the caller's is 0, side streams 1..)


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
    split: bool = False,
    graphed: bool = False,
) -> list[SimOp]:
    """The ops of one training step of ``record`` with ``stage_stream`` placing stage calls.

    ``stage_stream`` maps the ``call_id`` of each stage call to its side stream (``0..``);
    every other op runs on the caller's stream. The forward joins each stage before the
    caller goes on; the backward is the forward reversed (module docstring).
    ``one_stream``: the same ops on one stream, with no fork, join or wait (and no split).
    ``split``: the weight-gradient split (module docstring). ``graphed``: priced as a
    CUDA graph replay (module docstring).
    """
    from .cost import ELEMENTS_PER_BLOCK
    from .observe import CallRecord as Call

    split = split and not one_stream
    ops: list[SimOp] = []
    fwd: list[tuple[int, int, ObservedOp, bool]] = []  # (sim index, stream, op, split)
    last: dict[int, int] = {}  # stream -> its last op's index
    # A replayed graph issues nothing per kernel; its event forks and joins are edges.
    launch = 0.0 if graphed else gpu.launch_us
    half = 0.0 if graphed else gpu.fork_join_us / 2
    layer_host = split_host_us(gpu) / 2 if split and not graphed else 0.0  # each pass
    floor = gpu.kernel_floor_us
    layers = {call.name for call in record.calls() if call.params}  # modules with weights

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
                    waits = (*head.waits, caller_last)
                    ops[first] = replace(head, waits=waits, host_us=head.host_us + half)
                add(SimOp(0, 0.0, waits=(last[target],), host_us=half))  # the join
                continue
            launches = item.device_us > 0
            splits_here = split and launches and call.name in layers and splits(item.name)
            host = (launch if launches else 0.0) + (layer_host if splits_here else 0.0)
            index = add(
                SimOp(
                    stream,
                    item.device_us,
                    item.occupancy,
                    host_us=host,
                    floor_us=min(floor, item.device_us),
                )
            )
            if launches:
                fwd.append((index, stream, item, splits_here))

    if graphed:  # the replay itself: one launch, before anything runs
        add(SimOp(0, 0.0, host_us=gpu.launch_us))
    visit(record, 0)
    for _ in range(2):  # the loss (a reduction of the output) and its gradient's seed
        add(SimOp(0, floor, 1 / gpu.sm_count, host_us=launch, floor_us=floor))
    # Backward: the forward kernels in reverse order, each after its consumers' backward.
    producer: dict[int, int] = {}  # storage -> position in ``fwd`` of its last writer
    consumers: list[list[int]] = [[] for _ in fwd]
    first: list[bool] = []
    for position, (_, _, op, _) in enumerate(fwd):
        first.append(not any(key in producer for key in op.reads))
        for key in op.reads:
            if key in producer:
                consumers[producer[key]].append(position)
        for key in (*op.writes, *op.fresh):
            producer[key] = position
    back: dict[int, int] = {}  # forward position -> its (input-gradient) backward op's index
    weight_grads: list[int] = []  # the dW ops, in backward order
    streams_used: set[int] = set()
    for position in range(len(fwd) - 1, -1, -1):
        _, stream, op, splits_here = fwd[position]
        waits = tuple(
            sorted(
                {
                    back[c]
                    for c in consumers[position]
                    if c in back and ops[back[c]].stream != stream
                }
            )
        )
        streams_used.add(stream)
        if not splits_here:
            factor, launches = backward_cost(op.name, first[position])
            device = op.device_us * factor
            host = launch * launches + half * len(waits)
            back[position] = add(
                SimOp(stream, device, op.occupancy, waits, host, floor_us=min(floor, device))
            )
            continue
        (di_factor, di_launches), (dw_factor, dw_launches) = split_cost(op.name, first[position])
        ready = last.get(stream)  # the output gradient is ready on the layer's stream after it
        # The layer's stream waits on the dW launched SPLIT_LAG split layers before.
        lag = (weight_grads[-SPLIT_LAG],) if len(weight_grads) >= SPLIT_LAG else ()
        device = op.device_us * di_factor
        host = launch * di_launches + half * (len(waits) + len(lag)) + layer_host
        back[position] = add(
            SimOp(stream, device, op.occupancy, (*waits, *lag), host, floor_us=min(floor, device))
        )
        # dW on the weight-gradient stream, after an event recorded once the output
        # gradient is ready (the fork), concurrent with the next layer's dI.
        device = op.device_us * dw_factor
        ordered = (*waits, *(() if ready is None else (ready,)))
        host = launch * dw_launches + half
        weight_grads.append(
            add(SimOp(_WGRAD, device, op.occupancy, ordered, host, floor_us=min(floor, device)))
        )
        streams_used.add(_WGRAD)
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
            add(SimOp(0, device, occupancy, host_us=launch, floor_us=floor))
    return ops


def estimate_arm(
    record: CallRecord,
    stage_ids: Mapping[int, int],
    gpu: ReferenceGPU,
    *,
    split: bool = False,
    graphed: bool = False,
) -> StepEstimate:
    """The one estimate of a candidate plan ("arm"): its simulated step against the plain
    model's, both priced alike. Every figure shown for a plan (its table, ``check()``, the
    command line) comes from here.

    Args:
        record: the observed forward (:func:`~ooo_wrap._planner.observe.observe`).
        stage_ids: the ``call_id`` of each stage call -> its side stream (``0..``); empty
            for no stage (the split alone, or nothing).
        gpu: the reference GPU of the costs.
        split: with the weight-gradient split in force (module docstring).
        graphed: priced as a CUDA graph replay, the plain model's step too.

    Returns:
        The :class:`~ooo_wrap._plan.StepEstimate`: the arm's step (``wrapped_us``) and the
        plain model's (``one_stream_us``: every op on one stream, no split), on ``gpu``.
    """
    wrapped = simulate(step_ops(record, stage_ids, gpu, split=split, graphed=graphed)).length_us
    plain = simulate(step_ops(record, {}, gpu, one_stream=True, graphed=graphed)).length_us
    return StepEstimate(wrapped, plain, gpu.name, graphed=graphed, split=split)
