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


def measure(
    device: torch.device | None = None, *, calls: int = 200, repeats: int = 15
) -> dict[str, Any]:
    """The three floors on ``device`` (the current CUDA device by default), in µs, with
    the device's name and SM count."""
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
