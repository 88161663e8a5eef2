"""Measure the cost model's host and device floors on this GPU, as a ``ReferenceGPU`` JSON.

Run: ``python benchmarks/calibrate.py OUT.json`` on a CUDA machine (the GPU kit runs it
through ``benchmarks/suite.py --reference-gpu OUT.json``). Three numbers are measured;
everything else (peak FLOP/s, bandwidth, SM count) is kept from the datasheet reference
(:data:`ooo_wrap.H200`), except the SM count, read from the device:

- ``launch_us``: host time to issue one tiny kernel from eager PyTorch (the median over
  repeats of ``calls`` in-place adds issued back to back, without a sync, per add);
- ``kernel_floor_us``: device time of one tiny kernel (CUDA events around ``calls``
  adds queued behind a sleep kernel, so that they run back to back on the device);
- ``fork_join_us``: what one stage call on a side stream adds to the host, through the
  wrapper itself: the chain of ``benchmarks/overhead.py`` (24 tiny stages) wrapped with
  the static planner against the plain chain, per stage call, forwards only.

It also measures, without putting it in the reference, how much two GEMMs of the same
shape overlap on two streams (``concurrent_gemms``: the two-tower model's GEMMs, float32
and bfloat16), next to what the cost model's occupancy predicts for them: the
measurement that decides whether that model is right for such kernels.

Pass the JSON as ``gpu=`` to ``ooo_wrap.plan``, ``ooo_wrap.testing.check`` or
``OOOModule`` (or ``--gpu PATH`` to the CLI) to plan and estimate with these numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ooo_wrap import H200, OOOModule, ReferenceGPU

__all__ = ["measure", "reference_gpu"]


def _launch_us(device: torch.device, calls: int, repeats: int) -> float:
    x = torch.zeros(1, device=device)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            x.add_(1.0)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize(device)
    return statistics.median(samples)


def _kernel_floor_us(device: torch.device, calls: int, repeats: int) -> float:
    x = torch.zeros(1, device=device)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(1_000_000)  # the host queues the adds while the device sleeps
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            x.add_(1.0)
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / calls * 1e3)
    return statistics.median(samples)


def _fork_join_us(device: torch.device, calls: int, repeats: int) -> float:
    from benchmarks import overhead

    plain = overhead.Chain().to(device)
    wrapped = OOOModule(overhead.Chain().to(device), planner="static", tune=False)
    x = torch.randn(4, 64, device=device, requires_grad=True)
    samples = []
    for _ in range(repeats):
        seconds = []
        for model in (plain, wrapped):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                model(x)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        samples.append((seconds[1] - seconds[0]) / calls / overhead.NUM_STAGES * 1e6)
    return max(0.0, statistics.median(samples))


# (rows, inner, columns) of each GEMM timed in pairs: the two-tower model's forward GEMMs
# (Linear(512, 2048) and Linear(2048, 512) at batch 1024).
GEMM_SHAPES = ((1024, 512, 2048), (1024, 2048, 512))


def _overlap_estimate(
    shape: tuple[int, int, int], dtype: torch.dtype, calls: int
) -> tuple[float, float]:
    """The cost model's (occupancy, serial / concurrent) for ``calls`` GEMMs of ``shape``
    on each of two streams, device time only."""
    from ooo_wrap._planner.cost import estimate_op
    from ooo_wrap._planner.simulate import SimOp, simulate

    m, k, n = shape
    a = torch.empty(m, k, device="meta", dtype=dtype)
    b = torch.empty(k, n, device="meta", dtype=dtype)
    cost = estimate_op(torch.ops.aten.mm.default, (a, b), {}, a @ b, H200)
    op = SimOp(0, cost.device_us, cost.occupancy, floor_us=H200.kernel_floor_us)
    serial = simulate([op] * (2 * calls)).length_us
    sides = [dataclasses.replace(op, stream=s) for s in (1, 2) for _ in range(calls)]
    return cost.occupancy, serial / simulate(sides).length_us


def _gemms_ms(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    sides: Sequence[torch.cuda.Stream] | None,
    calls: int,
) -> float:
    """Device ms of ``calls`` GEMMs of each pair: all on the current stream (``sides``
    None), or each pair's on its own side stream, forked from and joined to it."""
    main = torch.cuda.current_stream()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record(main)
    for index, (a, b) in enumerate(pairs):
        stream = main if sides is None else sides[index]
        if stream is not main:
            stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for _ in range(calls):
                torch.mm(a, b)
    for side in sides or ():
        main.wait_stream(side)
    end.record(main)
    end.synchronize()
    return float(begin.elapsed_time(end))


def _concurrent_gemms(device: torch.device, calls: int, repeats: int) -> list[dict[str, Any]]:
    """Per GEMM shape and dtype: the device time of ``calls`` GEMMs of each of two pairs
    on one stream and on two side streams (medians, interleaved, after two warm-up
    rounds), their ratio, and the cost model's prediction of it."""
    results = []
    with torch.cuda.device(device):
        sides = [torch.cuda.Stream() for _ in range(2)]
        for shape in GEMM_SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                m, k, n = shape
                pairs = [
                    (torch.randn(m, k, device=device, dtype=dtype),
                     torch.randn(k, n, device=device, dtype=dtype))
                    for _ in sides
                ]  # fmt: skip
                serial, concurrent = [], []
                for repeat in range(repeats + 2):
                    one, two = _gemms_ms(pairs, None, calls), _gemms_ms(pairs, sides, calls)
                    if repeat >= 2:
                        serial.append(one)
                        concurrent.append(two)
                occupancy, estimated = _overlap_estimate(shape, dtype, calls)
                one_ms, two_ms = statistics.median(serial), statistics.median(concurrent)
                results.append(
                    {
                        "shape": f"{m}x{k} @ {k}x{n}",
                        "dtype": str(dtype).removeprefix("torch."),
                        "calls_per_stream": calls,
                        "serial_ms": one_ms,
                        "concurrent_ms": two_ms,
                        "measured_overlap": one_ms / two_ms,
                        "estimated_overlap": estimated,
                        "estimated_occupancy": occupancy,
                    }
                )
    return results


def measure(
    device: torch.device | None = None, *, calls: int = 200, repeats: int = 15
) -> dict[str, Any]:
    """The three floors on ``device`` (the current CUDA device by default), in µs, with
    the device's name and SM count, and the GEMM overlap measurements (module doc)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for _ in range(3):  # warm-up: kernels loaded, allocator and streams ready
        _launch_us(device, calls, 1)
        _fork_join_us(device, 10, 1)
    properties = torch.cuda.get_device_properties(device)
    return {
        "device": torch.cuda.get_device_name(device),
        "sm_count": int(properties.multi_processor_count),
        "launch_us": _launch_us(device, calls, repeats),
        "kernel_floor_us": _kernel_floor_us(device, calls, repeats),
        "fork_join_us": _fork_join_us(device, max(calls // 10, 5), repeats),
        "concurrent_gemms": _concurrent_gemms(device, max(calls // 10, 5), repeats),
    }


def reference_gpu(measured: dict[str, Any], base: ReferenceGPU = H200) -> ReferenceGPU:
    """``base`` with the measured floors and SM count, named after the measured device."""
    return dataclasses.replace(
        base,
        name=f"{measured['device']} (measured launch, fork/join and kernel floor; "
        f"peaks from the {base.name.split(' (')[0]} datasheet)",
        sm_count=int(measured["sm_count"]),
        launch_us=float(measured["launch_us"]),
        kernel_floor_us=float(measured["kernel_floor_us"]),
        fork_join_us=float(measured["fork_join_us"]),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Measure and write the JSON; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", type=Path, help="where to write the ReferenceGPU JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible to PyTorch; calibration needs one", file=sys.stderr)
        return 2
    gpu = reference_gpu(measure())
    gpu.save(args.path)
    print(f"{args.path}: {gpu.name}: launch {gpu.launch_us:.2f} µs, fork/join "
          f"{gpu.fork_join_us:.2f} µs, kernel floor {gpu.kernel_floor_us:.2f} µs")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
