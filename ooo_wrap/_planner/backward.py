"""What the backward of a forward op costs in the step simulator, with and without the split.

Pure numbers, no torch: the factors and kernel counts ``simulate.step_ops`` prices a
modelled backward with, the split of a matmul's or convolution's backward into its input
gradient (dI) and weight gradient (dW), and the host time the weight-gradient split adds
per layer call. Every figure is an estimate on a reference GPU, never a measurement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cost import ReferenceGPU

__all__ = [
    "BACKWARD_FACTOR",
    "BACKWARD_LAUNCHES",
    "SPLIT_HOST_LAUNCHES",
    "SPLIT_LAG",
    "backward_cost",
    "split_cost",
    "split_host_us",
    "splits",
]

# (times the forward's device time, kernels), of the backward of one forward kernel.
Cost = tuple[float, float]

# The backward of a forward kernel, as (times its device time, kernels), by the op's name:
# a matmul's is two matmuls (and a bias reduction for ``addmm``), a convolution's one
# ``convolution_backward``; an in-place op (a running-statistics update) and a
# concatenation (its backward is views) launch none; any other op about one kernel a bit
# slower than its forward. An estimate, like the costs it scales. Each listed op has two:
# its usual backward, and the one of a matmul or convolution of the step's inputs (the
# first layer), which needs no input gradient.
BACKWARD_FACTOR = 1.15
BACKWARD_LAUNCHES = 1.0
_BACKWARD: dict[str, tuple[Cost, Cost]] = {
    "addmm": ((2.05, 3.0), (1.05, 2.0)),
    "mm": ((2.0, 2.0), (1.0, 1.0)),
    "bmm": ((2.0, 2.0), (1.0, 1.0)),
    "baddbmm": ((2.05, 3.0), (1.05, 2.0)),
    "convolution": ((1.35, 1.0), (0.7, 1.0)),
    "cat": ((0.0, 0.0), (0.0, 0.0)),
    "stack": ((0.0, 0.0), (0.0, 0.0)),
}

# The same backward split in two, (dI, dW), for the ops a split layer runs (an
# ``nn.Linear`` is ``addmm`` or ``mm``, an ``nn.ConvNd`` ``convolution``): the two
# matmuls of ``_BACKWARD`` apart (the bias reduction goes with dW), and a convolution's
# ``convolution_backward`` as two kernels, one per output mask (dW as for the first layer,
# dI the rest). Each pair sums to the op's usual ``_BACKWARD`` factor.
_SPLIT: dict[str, tuple[Cost, Cost]] = {
    "addmm": ((1.0, 1.0), (1.05, 2.0)),
    "mm": ((1.0, 1.0), (1.0, 1.0)),
    "convolution": ((0.65, 1.0), (0.7, 1.0)),
}

# Host time the split adds per split layer call, forward plus backward, in kernel launches
# of the reference GPU (``ReferenceGPU.launch_us``), so it scales as the reference's other
# host costs do. From ``python -m benchmarks.wgrad`` on this project's 2-core CPU machine
# (torch 2.13.0, 2026-12-03): the split adds 119 µs to a stock nn.Linear(16, 16) call's
# 46.8 µs, forward plus backward, i.e. 2.54 times that call's host time; a stock Linear
# call issues 4 kernels (addmm; two mm and the bias sum in backward), 4 launches on the
# reference, so the split adds 119 / 46.8 * 4 = 10.2 launches (50.9 µs on the H200
# reference's 5 µs). The stream calls of a split layer on a GPU (event record and wait,
# record_stream) come on top, priced as the simulator prices every fork.
SPLIT_HOST_LAUNCHES = 119.0 / 46.8 * 4
# The weight-gradient stream may lag the layer's stream by this many split layers' dW
# before the layer's stream waits. The runtime bounds the lag in bytes instead (what the
# pending dWs hold, within ``wgrad.HELD_FRACTION`` of the live bytes); two layers is the
# simulator's stand-in for it, since an observed forward carries no device memory figure.
SPLIT_LAG = 2


def _packet(name: str) -> str:
    """``addmm`` for ``aten.addmm.default``."""
    return name.split(".")[1] if name.startswith("aten.") else name


def backward_cost(name: str, first: bool = False) -> Cost:
    """(device-time factor, kernels) of the backward of the forward op ``name``
    (``aten.addmm.default``); ``first``: it reads nothing another op of the forward made
    (only inputs and parameters), so a matmul's input gradient is not computed."""
    packet = _packet(name)
    if packet in _BACKWARD:
        usual, first_layer = _BACKWARD[packet]
        return first_layer if first else usual
    if packet.endswith("_") and not packet.startswith("_"):
        return (0.0, 0.0)
    return (BACKWARD_FACTOR, BACKWARD_LAUNCHES)


def splits(name: str) -> bool:
    """Whether a split layer's op ``name`` runs its backward as dI and dW apart."""
    return _packet(name) in _SPLIT


def split_cost(name: str, first: bool = False) -> tuple[Cost, Cost]:
    """(dI, dW) of the split backward of ``name`` (an op :func:`splits`), each as
    (device-time factor, kernels); ``first``: no input gradient, so dI launches none."""
    d_input, d_weight = _SPLIT[_packet(name)]
    return ((0.0, 0.0) if first else d_input), d_weight


def split_host_us(gpu: ReferenceGPU) -> float:
    """Host µs the split adds per split layer call on ``gpu``, eagerly launched."""
    return SPLIT_HOST_LAUNCHES * gpu.launch_us
