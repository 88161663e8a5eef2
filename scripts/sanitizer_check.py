"""Training steps of every benchmark model under the CUDA Stream Sanitizer, or a race it must flag.

Run under ``TORCH_CUDA_SANITIZER=1`` (``scripts/gpu_check.sh`` does)::

    TORCH_CUDA_SANITIZER=1 python scripts/sanitizer_check.py            # must report nothing
    TORCH_CUDA_SANITIZER=1 python scripts/sanitizer_check.py --broken   # must be flagged

With that variable set, ``import torch`` switches on ``torch.cuda._sanitizer``: it tracks
every kernel's reads and writes per stream and every event record and wait, prints each
unsynchronized access to stderr ("CSAN detected a possible data race ...") and raises.
The clean mode exits 0 only if every step of every wrapped model ran; the broken mode
exits 0 only if the sanitizer raised on a deliberate race, so a sanitizer that is silent
(not enabled, or not working) cannot make the clean mode's pass meaningless.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path[0] != str(ROOT):  # check this checkout's library and models
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import ooo_wrap  # noqa: E402
from benchmarks.models import ModelSpec  # noqa: E402
from examples import quickstart  # noqa: E402

EXIT_SETUP = 2  # not run: no GPU, or the sanitizer is not switched on


@dataclass(frozen=True)
class Case:
    """A model to train under the sanitizer: how to build it, feed it and score it."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _spec_case(spec: ModelSpec, batch: int) -> Case:
    return Case(spec.label, spec.build, lambda d: spec.make_batch(batch, d), spec.loss)


def cases() -> list[Case]:
    """Every benchmark family at a small size, and the quickstart's Towers."""

    def quickstart_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(8, quickstart.IN_FEATURES, generator=gen)
        y = torch.randint(0, quickstart.CLASSES, (8,), generator=gen)
        return x.to(device), y.to(device)

    return [
        _spec_case(ModelSpec.towers(4, 256, 2), 8),
        _spec_case(ModelSpec.branches(4, 16, 2, 16), 4),
        _spec_case(ModelSpec.transformer(), 4),
        Case(
            "quickstart Towers",
            quickstart.build_model,
            quickstart_batch,
            lambda out, y: F.cross_entropy(out.float(), y),
        ),
    ]


def train(case: Case, device: torch.device, steps: int, dtype: torch.dtype | None) -> str:
    """``steps`` training steps of ``case`` wrapped; returns a one-line account."""
    model = ooo_wrap.OOOModule(case.build().to(device), streams=4)
    if not isinstance(model, ooo_wrap.OOOModule):
        events = "; ".join(str(e) for e in ooo_wrap.events_for(model))
        raise RuntimeError(f"{case.name} was not wrapped on {device}: {events}")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    inputs, target = case.batch(device)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        precision = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with precision:
            output = model(inputs)
        case.loss(output, target).backward()
        optimizer.step()
    torch.cuda.synchronize(device)
    stats = model.stats
    return (
        f"ok: {case.name}, {'float32' if dtype is None else 'bfloat16 autocast'}: {steps} steps, "
        f"{len(model.plan.stages)} stages on {model.plan.num_streams} streams, "
        f"{stats.stage_calls} stage calls, {stats.waits} waits, "
        f"{stats.record_streams} record_stream calls"
    )


def broken(device: torch.device) -> int:
    """A two-stream program with its wait left out; 0 if the sanitizer flags it, else 1."""
    x = torch.rand(1 << 16, device=device)  # written on the current (default) stream
    side = torch.cuda.Stream(device)
    try:
        # The bug, on purpose: no side.wait_stream(torch.cuda.current_stream()), so the
        # read of x below may run before torch.rand has finished writing it.
        with torch.cuda.stream(side):
            y = x * 2
        torch.cuda.synchronize(device)
    except Exception as error:
        # torch.cuda._sanitizer.CUDASanitizerErrors; matched by name, as it is private.
        if type(error).__name__ != "CUDASanitizerErrors":
            raise
        print(f"flagged as it must be: the sanitizer raised {type(error).__name__} ({error})")
        return 0
    print(
        f"FAIL: the sanitizer did not flag an unsynchronized cross-stream read "
        f"(sum {float(y.sum()):.1f}); a silent sanitizer cannot vouch for the clean run"
    )
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the clean check (default) or the broken program; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--broken", action="store_true", help="run the deliberate race")
    parser.add_argument("--steps", type=int, default=3, help="training steps per model")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the CUDA Stream Sanitizer check needs a CUDA GPU", file=sys.stderr)
        return EXIT_SETUP
    if "TORCH_CUDA_SANITIZER" not in os.environ:
        print(
            "error: run with TORCH_CUDA_SANITIZER=1 in the environment (torch reads it at "
            "import), e.g. TORCH_CUDA_SANITIZER=1 python scripts/sanitizer_check.py",
            file=sys.stderr,
        )
        return EXIT_SETUP
    device = torch.device("cuda", torch.cuda.current_device())
    if args.broken:
        return broken(device)
    runs = 0
    for case in cases():
        for dtype in (None, torch.bfloat16):
            print(train(case, device, args.steps, dtype), flush=True)
            runs += 1
    print(f"CSAN: no reports in {runs} runs of {args.steps} training steps each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
