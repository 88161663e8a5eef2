"""Host cost and memory of the weight-gradient split (``split_weight_grads=True``) on the CPU.

Run: ``python benchmarks/wgrad.py``.

- *Host cost per split layer call.* A chain of 24 ``nn.Linear(16, 16)`` layers (batch 4: the
  math is negligible, the Python is not) trains plain and split, interleaved after a
  warm-up, with :class:`~benchmarks.overhead.NullBackend` (stream calls do nothing, as the
  overhead benchmark does); the median over repeats of ``(split - plain) / 24`` is what
  the split adds to one layer call, forward plus backward, on the host. Device stream
  calls come on top on a GPU (per layer call: a stream switch around the pass-through
  node; in backward an event record and wait, three ``record_stream``, two stream
  switches, and the lag bound's record and wait).
- *Peak memory* of one training step of a pre-norm transformer block (the test suite's
  ``Block``, width 256, 8 x 128 tokens), plain and split on virtual streams, measured as
  the peak of live tensor bytes (every storage an op allocates, until it is freed). On the
  CPU every op runs in program order, so this shows what the split itself allocates; on
  a GPU the weight-gradient stream may also lag, holding each pending layer's output
  gradient and input: the lag bound (``LAG`` layers) caps that, and the second figure is
  the plain peak plus the largest ``LAG`` consecutive layers' held bytes, an upper bound.
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
from ooo_wrap._runtime.wgrad import LAG
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


def _peak(model: nn.Module, x: torch.Tensor) -> int:
    with _LiveBytes() as mode:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    return mode.peak


def peak_memory(width: int = 256, batch: int = 8, tokens: int = 128) -> dict[str, float]:
    """Peak live bytes of a transformer block's step, plain and split (see the docstring)."""
    torch.manual_seed(0)
    plain = Block(width, heads=4)
    split = ooo_wrap.OOOModule(
        copy.deepcopy(plain), backend=SimulatedBackend(), split_weight_grads=True, tune=False
    )
    x = torch.randn(batch, tokens, width)
    _peak(split, x)  # the learning step
    plain_peak, split_peak = _peak(plain, x), _peak(split, x)
    assert split.stats.split_layer_calls > 0, split.events
    element = x.element_size() * batch * tokens
    # Per layer of the block in backward order: its output gradient and its input.
    held = [(4 * width + width) * element, (width + 4 * width) * element]  # fc2, fc1
    held += [(width + width) * element, (3 * width + width) * element]  # proj, qkv
    worst = max(sum(held[i : i + LAG]) for i in range(len(held) - LAG + 1))
    return {
        "plain_peak_bytes": plain_peak,
        "split_peak_bytes": split_peak,
        "ratio_cpu": split_peak / plain_peak,
        "lag_layers": LAG,
        "ratio_bound_gpu": (plain_peak + worst) / plain_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    result = {"host": host_cost(args.repeats), "memory": peak_memory()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
