"""A cost model for one dispatched aten op: estimated device time on a named reference GPU.

It is an estimate, never a measurement: nothing here runs on a device. Shared by the race
checker's trace (which lays ops out on a virtual clock) and by anything that plans from
estimated costs, so both speak of the same microseconds.

Model, per op (a roofline with a floor and an occupancy term)::

    flops      from torch.utils.flop_counter's registered formula for the op (mm, addmm,
               bmm, convolution and its backward, attention, ...); 0 for every other op.
               A CPU-only kernel counts as the GPU kernel it stands for (CPU flash
               attention as flash attention)
    bytes      the bytes of every tensor argument read plus every tensor result written
               (numel * element size; a broadcast view counts its logical size)
    occupancy  min(1, ceil(work / ELEMENTS_PER_BLOCK) / sm_count), work being the largest
               numel among the op's tensors: a kernel too small to fill the SMs gets only
               that fraction of the peak FLOP/s and of the memory bandwidth
    device_us  max(flops / (peak(dtype) * occupancy), bytes / (bandwidth * occupancy))
               * 1e6 + kernel_floor_us

Views and metadata ops (``func.is_view``, ``empty``, ``size``, ``lift_fresh``, ...) launch
no kernel: they cost 0 and ``launches`` is False. The host issues ops one at a time,
``launch_us`` each; moving a stage to a side stream and back costs the host
``fork_join_us``. Concurrent kernels are not modelled here; callers that overlap them
decide how (``simulate`` shares the GPU among them by occupancy).

API (stable)::

    ReferenceGPU          frozen dataclass: name, peak_flops, memory_bandwidth, sm_count,
                          kernel_floor_us, launch_us, fork_join_us; .peak(dtype);
                          .to_json() / from_json(text), .save(path) / load(path)
    as_reference_gpu(gpu) a ReferenceGPU, a path to its JSON, or None (the default) ->
                          ReferenceGPU or None
    H200                  the default ReferenceGPU (public NVIDIA H200 SXM numbers)
    OpCost                frozen dataclass: flops, bytes, occupancy, device_us, launches
    launches_kernel(func) whether an op launches a device kernel at all
    estimate_op(func, args, kwargs, out, gpu=H200) -> OpCost

Example::

    >>> a, b = torch.randn(64, 128), torch.randn(128, 32)
    >>> cost = estimate_op(torch.ops.aten.mm.default, (a, b), {}, a @ b)
    >>> cost.flops
    524288
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import flop_formulas
from .._errors import OOOConfigError
from .._tensors import tensors_in
from .intercept import OpArgs, OpKwargs, OpOverload

__all__ = [
    "ELEMENTS_PER_BLOCK",
    "H200",
    "GPULike",
    "OpCost",
    "ReferenceGPU",
    "as_reference_gpu",
    "estimate_op",
    "launches_kernel",
]

# Elements one thread block handles (a 64x64 output tile, or 256 threads x 16 elements):
# what decides whether a kernel has enough blocks to occupy every SM.
ELEMENTS_PER_BLOCK = 4096

# Ops that allocate, describe or re-tag memory without launching a kernel.
_NO_KERNEL = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "lift_fresh",
        "resize_",
        "set_",
        "size",
        "stride",
        "numel",
        "dim",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "record_stream",
        "_has_compatible_shallow_copy_type",
    }
)


@dataclass(frozen=True)
class ReferenceGPU:
    """The numbers an estimate is computed from; named so every estimate can say whose.

    Attributes:
        name: shown next to every estimate.
        peak_flops: dense peak FLOP/s per dtype, as ``(dtype, flops)`` pairs.
        memory_bandwidth: bytes per second.
        sm_count: streaming multiprocessors, for the occupancy term.
        kernel_floor_us: the least device time of any kernel (launch latency and tail).
        launch_us: host time to issue one op from eager PyTorch.
        fork_join_us: host time to run one stage call on a side stream and join it back
            (event records, waits and ``record_stream`` on entry and exit).
    """

    name: str
    peak_flops: tuple[tuple[torch.dtype, float], ...]
    memory_bandwidth: float
    sm_count: int
    kernel_floor_us: float
    launch_us: float
    fork_join_us: float

    def __post_init__(self) -> None:
        if not self.peak_flops or any(flops <= 0 for _, flops in self.peak_flops):
            raise ValueError(f"ReferenceGPU {self.name!r}: peak_flops needs positive entries")
        if self.memory_bandwidth <= 0 or self.sm_count <= 0:
            raise ValueError(
                f"ReferenceGPU {self.name!r}: memory_bandwidth and sm_count must be positive"
            )

    def peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``; the float32 entry (or the first) for dtypes not listed."""
        table = dict(self.peak_flops)
        return table.get(dtype, table.get(torch.float32, self.peak_flops[0][1]))

    def to_json(self) -> str:
        """This reference as JSON text; dtypes by name (``"float32"``), loadable by
        :meth:`from_json`.

        Example::

            >>> ReferenceGPU.from_json(H200.to_json()) == H200
            True
        """
        data: dict[str, Any] = {
            "name": self.name,
            "peak_flops": {str(dtype).removeprefix("torch."): f for dtype, f in self.peak_flops},
            "memory_bandwidth": self.memory_bandwidth,
            "sm_count": self.sm_count,
            "kernel_floor_us": self.kernel_floor_us,
            "launch_us": self.launch_us,
            "fork_join_us": self.fork_join_us,
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ReferenceGPU:
        """The reference :meth:`to_json` wrote.

        Args:
            text: JSON with every field of :class:`ReferenceGPU`; ``peak_flops`` maps
                torch dtype names (``"float32"``, ``"bfloat16"``) to FLOP/s.

        Returns:
            The :class:`ReferenceGPU`.

        Raises:
            ValueError: the text is not JSON, a field is missing, unknown or of the
                wrong type, a dtype name is not a torch dtype, or a value is out of range.
        """
        try:
            data = json.loads(text)
        except ValueError as error:
            raise ValueError(f"a ReferenceGPU JSON must be JSON: {error}") from None
        fields = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or set(data) != fields:
            have = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"a ReferenceGPU JSON needs exactly {sorted(fields)}, got {have}")
        peaks = data["peak_flops"]
        if not isinstance(peaks, dict):
            raise ValueError("peak_flops must map dtype names to FLOP/s, e.g. {'float32': 6.7e13}")
        pairs = []
        for dtype_name, flops in peaks.items():
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"peak_flops: {dtype_name!r} is not a torch dtype name")
            pairs.append((dtype, _number(flops, f"peak_flops[{dtype_name!r}]")))
        sm_count = data["sm_count"]
        if isinstance(sm_count, bool) or not isinstance(sm_count, int):
            raise ValueError(f"sm_count must be an int, got {sm_count!r}")
        if not isinstance(data["name"], str):
            raise ValueError(f"name must be a string, got {data['name']!r}")
        floors = {
            key: _number(data[key], key) for key in ("kernel_floor_us", "launch_us", "fork_join_us")
        }
        if any(value < 0 for value in floors.values()):
            raise ValueError(f"kernel_floor_us, launch_us and fork_join_us must be >= 0: {floors}")
        return cls(
            name=data["name"],
            peak_flops=tuple(pairs),
            memory_bandwidth=_number(data["memory_bandwidth"], "memory_bandwidth"),
            sm_count=sm_count,
            **floors,
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path``."""
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ReferenceGPU:
        """The reference saved at ``path`` (see :meth:`from_json`; raises as it does, and
        ``OSError`` if the file cannot be read)."""
        with open(path, encoding="utf-8") as file:
            return cls.from_json(file.read())


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    return float(value)


GPULike = ReferenceGPU | str | os.PathLike[str]


def as_reference_gpu(gpu: object, where: str = "gpu") -> ReferenceGPU | None:
    """``gpu=`` as given to ``plan``, ``check`` or ``OOOModule``: a :class:`ReferenceGPU`,
    a path to one's JSON (loaded now), or ``None`` for the default (:data:`H200`).

    Raises:
        OOOConfigError: anything else, or a path that cannot be read as a reference.
    """
    if gpu is None or isinstance(gpu, ReferenceGPU):
        return gpu
    if isinstance(gpu, (str, os.PathLike)):
        try:
            return ReferenceGPU.load(gpu)
        except (OSError, ValueError) as error:
            raise OOOConfigError(
                f"{where}={os.fspath(gpu)!r}: cannot load a ReferenceGPU JSON from it "
                f"({error}); write one with ReferenceGPU.save or the GPU kit"
            ) from None
    raise OOOConfigError(
        f"{where} must be a ReferenceGPU, a path to its JSON or None, got {gpu!r}; "
        "None estimates on the H200 datasheet figures"
    )


# NVIDIA H200 SXM datasheet, dense (no sparsity) peaks: FP64 34 TFLOPS (67 on tensor cores),
# FP32 67 TFLOPS, BF16/FP16 tensor cores 989 TFLOPS, FP8 and INT8 1979; HBM3e 4.8 TB/s;
# 132 SMs. float32 matmuls use the FP32 figure because PyTorch's default float32 matmul
# precision ("highest") does not use TF32. The three host/device floors are typical eager
# PyTorch figures, not measured on this GPU: estimates, like everything computed from them.
H200 = ReferenceGPU(
    name="NVIDIA H200 SXM (estimate from public specs)",
    peak_flops=(
        (torch.float64, 67e12),
        (torch.float32, 67e12),
        (torch.bfloat16, 989e12),
        (torch.float16, 989e12),
        (torch.float8_e4m3fn, 1979e12),
        (torch.float8_e5m2, 1979e12),
        (torch.int8, 1979e12),
    ),
    memory_bandwidth=4.8e12,
    sm_count=132,
    kernel_floor_us=2.0,
    launch_us=5.0,
    fork_join_us=10.0,
)


@dataclass(frozen=True)
class OpCost:
    """One op's estimated cost on a :class:`ReferenceGPU`.

    Attributes:
        flops: from the op's registered FLOP formula, 0 if it has none.
        bytes: bytes read from tensor arguments plus bytes written to tensor results.
        occupancy: fraction of the SMs the kernel can fill, in (0, 1].
        device_us: estimated device time in µs; 0 when the op launches no kernel.
        launches: whether the op launches a kernel (views and metadata ops do not).
    """

    flops: int
    bytes: int
    occupancy: float
    device_us: float
    launches: bool


_FREE = OpCost(flops=0, bytes=0, occupancy=1.0, device_us=0.0, launches=False)


def launches_kernel(func: OpOverload) -> bool:
    """Whether ``func`` launches a device kernel (views and metadata ops do not)."""
    return not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL


# CPU kernels whose GPU counterpart has a formula and the same leading arguments (by aten
# name): the checker records CPU ops but estimates the GPU's.
_GPU_TWIN = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "_scaled_dot_product_flash_attention_backward"
    ),
}
# flop_counter's formula table and the code its shape_wrapper's formulas share, looked up on
# the first estimate (empty where this torch has no table; _compat warns once).
_formulas: list[Any] = []


def _formula(packet: Any) -> Any:
    """The FLOP formula for an overload packet (or its GPU twin's), or ``None``."""
    if not _formulas:
        _formulas.extend(flop_formulas())
    registry, _ = _formulas
    twin = _GPU_TWIN.get(packet.__name__)
    return registry.get(packet if twin is None else getattr(torch.ops.aten, twin, None))


def _shapes(value: Any) -> Any:
    """``value`` with every tensor replaced by its shape, through lists and tuples."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (list, tuple)):
        return [_shapes(item) for item in value]
    return value


def _flops(func: OpOverload, args: OpArgs, kwargs: OpKwargs, out: Any) -> int:
    """FLOPs from torch.utils.flop_counter's formula table (keyed by overload packet)."""
    formula = _formula(func.overloadpacket)
    if formula is None:
        return 0
    try:
        if getattr(formula, "__code__", None) is _formulas[1] is not None:
            # The wrapper maps tensors to shapes with a pytree walk that costs ~100 µs a
            # call; the formula beneath it (functools.wraps keeps it) takes the shapes.
            raw = formula.__wrapped__
            shaped = {key: _shapes(value) for key, value in kwargs.items()}
            return int(raw(*_shapes(list(args)), out_shape=_shapes(out), **shaped))
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that cannot read unusual arguments: count none, not crash
        return 0


def estimate_op(
    func: OpOverload, args: OpArgs, kwargs: OpKwargs, out: Any, gpu: ReferenceGPU = H200
) -> OpCost:
    """Estimate one dispatched op's device time on ``gpu`` (see the module docstring).

    Args:
        func: the aten overload, as a ``TorchDispatchMode`` sees it.
        args, kwargs: its arguments (real, fake or meta tensors: only shapes are read).
        out: its result.
        gpu: the reference GPU; :data:`H200` by default.

    Returns:
        An :class:`OpCost`; all zero with ``launches=False`` for views and metadata ops.
    """
    if not launches_kernel(func):
        return _FREE
    inputs = tensors_in(args) + tensors_in(kwargs)
    outputs = tensors_in(out)
    tensors = inputs + outputs
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flops = _flops(func, args, kwargs, out)
    work = max((t.numel() for t in tensors), default=0)
    occupancy = min(1.0, max(1, math.ceil(work / ELEMENTS_PER_BLOCK)) / gpu.sm_count)
    dtype = next(
        (t.dtype for t in inputs if t.is_floating_point()),
        inputs[0].dtype if inputs else torch.float32,
    )
    seconds = max(
        flops / (gpu.peak(dtype) * occupancy), nbytes / (gpu.memory_bandwidth * occupancy)
    )
    return OpCost(
        flops=flops,
        bytes=nbytes,
        occupancy=occupancy,
        device_us=seconds * 1e6 + gpu.kernel_floor_us,
        launches=True,
    )
