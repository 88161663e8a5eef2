"""Host cost and memory of the weight-gradient split (``split_weight_grads=True``) on the CPU.

Run: ``python benchmarks/wgrad.py``.

- *Host cost per split layer call.* A chain of 24 ``nn.Linear(16, 16)`` layers (batch 4: the
  math is negligible, the Python is not) trains plain and split, interleaved after a
  warm-up, with :class:`~benchmarks.overhead.NullBackend` (stream calls do nothing, as the
  overhead benchmark does); the median over repeats of ``(split - plain) / 24`` is what
  the split adds to one layer call, forward plus backward, on the host. Device stream
  calls come on top on a GPU (per layer call: a stream switch around the pass-through
  node; in backward an event record and wait, three ``record_stream``, two stream
  switches, and the memory bound's record and, where its budget is spent, its wait).
- *Peak memory* of one training step of a pre-norm transformer block (the test suite's
  ``Block``, width 256, 8 x 128 tokens), plain and split on virtual streams, measured as
  the peak of live tensor bytes (every storage an op allocates, until it is freed). On the
  CPU every op runs in program order, so ``ratio_cpu`` shows what the split itself
  allocates. On a GPU the weight-gradient stream may also lag, and what it reads
  (``record_stream``) stays allocated until it ran: ``ratio_worst_gpu`` replays the step
  with the weight-gradient stream at its slowest (it runs nothing until a stream waits on
  it, so every block it reads stays alive until then) and the device's live bytes as the
  lag's budget sees them, which gives the peak a GPU can reach under the lag's byte
  budget, and ``ratio_unbounded_gpu`` the same without the budget (``W`` waited on only
  at the end of backward).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ooo_wrap
from benchmarks.overhead import NullBackend
from ooo_wrap._runtime.wgrad import HELD_FRACTION
from ooo_wrap.testing import SimulatedBackend
from tests.support.wgrad_models import Block

LAYERS = 24


def _chain() -> nn.Module:
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(LAYERS)))


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)


def host_cost(repeats: int = 30, calls: int = 20, warmup: int = 5) -> dict[str, float]:
    """µs the split adds per layer call (forward plus backward), median over repeats."""
    torch.manual_seed(0)
    plain = _chain()
    split = ooo_wrap.OOOModule(
        copy.deepcopy(plain), backend=NullBackend(), split_weight_grads=True, tune=False
    )
    x = torch.randn(4, 16)
    for _ in range(warmup):
        _step(plain, x)
        _step(split, x)
    assert split.stats.split_layer_calls > 0, split.events
    times: dict[str, list[float]] = {"plain": [], "split": []}
    for _ in range(repeats):
        for name, model in (("plain", plain), ("split", split)):
            start = time.perf_counter()
            for _ in range(calls):
                _step(model, x)
            times[name].append((time.perf_counter() - start) / calls)
    added = [(s - p) / LAYERS * 1e6 for s, p in zip(times["split"], times["plain"], strict=True)]
    plain_us = [p / LAYERS * 1e6 for p in times["plain"]]
    return {
        "added_us_per_layer_call": statistics.median(added),
        "plain_us_per_layer_call": statistics.median(plain_us),
    }


class _LiveBytes(TorchDispatchMode):
    """The peak of live tensor bytes: each new storage counted until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    size = storage.nbytes()
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, size)
        return out


class _SlowestWeightStream(SimulatedBackend):
    """Virtual streams where a side stream runs nothing until another stream waits on it:
    each tensor ``record_stream``-ed to it is kept alive until a wait on one of its events
    recorded after, or the end of the backward (the engine's wait on leaf streams). Its
    live bytes are those ``bytes`` counts."""

    def __init__(self, live: _LiveBytes | None = None) -> None:
        super().__init__()
        self.live = live
        self.held: list[tuple[Any, int, torch.Tensor]] = []  # stream, events before, tensor
        self._recorded: dict[Any, int] = {}  # stream -> events recorded on it
        self._event_index: dict[int, int] = {}  # event id -> its index on its stream

    def live_bytes(self, device: torch.device) -> int:
        return 0 if self.live is None else self.live.live

    def record_event(self, stream: Any, event: Any = None) -> Any:
        event = super().record_event(stream, event)
        self._recorded[stream] = self._event_index[event.id] = self._recorded.get(stream, 0) + 1
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        super().wait_event(stream, event)
        done = self._event_index[event.id]
        self.held = [h for h in self.held if not (h[0] == event.stream and h[1] < done)]

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        super().record_stream(tensor, stream)
        self.held.append((stream, self._recorded.get(stream, 0), tensor))


def _peak(model: nn.Module, x: torch.Tensor, backend: SimulatedBackend | None = None) -> int:
    with _LiveBytes() as mode:
        if isinstance(backend, _SlowestWeightStream):
            backend.live = mode
        model(x).square().mean().backward()
        if isinstance(backend, _SlowestWeightStream):
            backend.held.clear()  # the end of backward: the caller waited on every stream
    model.zero_grad(set_to_none=True)
    return mode.peak


def peak_memory(
    width: int = 256, batch: int = 8, tokens: int = 128, heads: int = 4
) -> dict[str, float]:
    """Peak live bytes of a transformer block's step, plain and split (see the docstring)."""
    torch.manual_seed(0)
    plain = Block(width, heads=heads)
    x = torch.randn(batch, tokens, width)
    plain_peak = _peak(plain, x)
    peaks = {}
    for name, backend in (
        ("cpu", SimulatedBackend()),
        ("worst_gpu", _SlowestWeightStream()),
        ("unbounded_gpu", _SlowestWeightStream()),
    ):
        split = ooo_wrap.OOOModule(
            copy.deepcopy(plain), backend=backend, split_weight_grads=True, tune=False
        )
        if name == "unbounded_gpu":  # a budget no step reaches
            backend.live_bytes = lambda device: 2**62  # type: ignore[method-assign]
        _peak(split, x, backend)  # the learning step
        peaks[name] = _peak(split, x, backend)
        assert split.stats.split_layer_calls > 0, split.events
    return {
        "plain_peak_bytes": plain_peak,
        "split_peak_bytes": peaks["cpu"],
        "ratio_cpu": peaks["cpu"] / plain_peak,
        "held_fraction": HELD_FRACTION,
        "ratio_worst_gpu": peaks["worst_gpu"] / plain_peak,
        "ratio_unbounded_gpu": peaks["unbounded_gpu"] / plain_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    result = {"host": host_cost(args.repeats), "memory": peak_memory()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
