"""The CUDA Stream Sanitizer on the wrapper: a preflight, clean runs, and races it must flag.

Run under ``TORCH_CUDA_SANITIZER=1`` (``scripts/gpu_check.sh`` does)::

    TORCH_CUDA_SANITIZER=1 python3 scripts/sanitizer_check.py [--quick] [--mode all]

With that variable set, ``import torch`` switches on ``torch.cuda._sanitizer`` (CSAN): it
tracks every kernel's reads and writes per stream and every event record and wait, prints
each unsynchronized access to stderr and raises. One process does, in order:

1. preflight: whether this sanitizer ignores ``record_stream``. Older ones count it as a
   write on the current stream, so code that calls it after recording its fork event
   (a correct pattern) is flagged; the answer explains any report in step 2.
2. clean: training steps of every benchmark model, wrapped (stages alone), and of the
   towers and the transformer with the weight-gradient split too
   (``split_weight_grads=True``: each layer's dW on the weight-gradient stream, inside
   the stages); each run must finish with no report.
3. broken: three races the sanitizer must flag, or its silence in step 2 proves nothing:
   a two-stream toy program without its wait, a benchmark model wrapped by the real
   wrapper with its fork wait removed (the stage's stream no longer waits for the
   caller's), the class of bug this wrapper could have, and a chain of layers with the
   weight-gradient split alone, with the same waits removed (the weight-gradient stream
   no longer waits for the layer's output gradient before computing dW).

The last line is the verdict; the exit status is 0 only if every clean run was silent and
every broken one was flagged.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if sys.path[0] != str(ROOT):  # check this checkout's library and models
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import ooo_wrap  # noqa: E402
from benchmarks.models import ModelSpec  # noqa: E402
from examples import quickstart  # noqa: E402
from ooo_wrap._runtime.backend import AcceleratorBackend  # noqa: E402

EXIT_SETUP = 2  # not run: no GPU, or the sanitizer is not switched on
SANITIZER_ERROR = "CUDASanitizerErrors"  # torch.cuda._sanitizer's, private: matched by name

B = TypeVar("B")


@dataclass(frozen=True)
class Case:
    """A model to train under the sanitizer: how to build it, feed it and score it."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _spec_case(spec: ModelSpec, batch: int) -> Case:
    return Case(spec.label, spec.build, lambda d: spec.make_batch(batch, d), spec.loss)


def cases(quick: bool = False) -> list[Case]:
    """Every benchmark family at a small size and the quickstart's Towers (quick: two)."""

    def quickstart_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(8, quickstart.IN_FEATURES, generator=gen)
        y = torch.randint(0, quickstart.CLASSES, (8,), generator=gen)
        return x.to(device), y.to(device)

    towers = _spec_case(ModelSpec.towers(4, 256, 2), 8)
    transformer = _spec_case(ModelSpec.transformer(), 4)
    if quick:
        return [towers, transformer]
    return [
        towers,
        _spec_case(ModelSpec.branches(4, 16, 2, 16), 4),
        transformer,
        Case(
            "quickstart Towers",
            quickstart.build_model,
            quickstart_batch,
            lambda out, y: F.cross_entropy(out.float(), y),
        ),
    ]


def _key(stream: Any) -> Any:
    """What identifies a stream: torch.cuda.Stream == torch.Stream is False for one stream."""
    if hasattr(stream, "stream_id"):
        return (stream.device_type, stream.device_index, stream.stream_id)
    return stream  # a virtual stream (CPU tests): compared as it is


def without_fork_wait(base: type[B]) -> type[B]:
    """``base`` (a backend class) with the fork wait removed: a deliberately broken wrapper.

    The scheduler makes three kinds of wait: the fork (a stage's side stream waits on an
    event of the caller's stream, while the caller's stream is current) and two joins (the
    current stream waits on a stage's event). Dropping every wait whose stream is not the
    current one drops exactly the fork, so a stage may read its inputs and parameters
    before the caller's stream has finished writing them.
    """

    class WithoutForkWait(base):  # type: ignore[valid-type,misc]
        name = "without-fork-wait"

        def wait_event(self, stream: Any, event: Any) -> None:
            current = self.current_stream(getattr(stream, "device", None))
            if _key(stream) != _key(current):
                return  # the bug, on purpose
            super().wait_event(stream, event)

    return WithoutForkWait


def split_chain() -> Case:
    """A chain of layers: with the weight-gradient split, its plan is the split alone."""

    def build() -> nn.Module:
        layers = [nn.Linear(256, 256) if i % 2 == 0 else nn.GELU() for i in range(7)]
        return nn.Sequential(*layers)

    def batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return torch.randn(16, 256, generator=gen).to(device), torch.zeros(16, 256).to(device)

    return Case("chain of 4 Linear(256, 256)", build, batch, F.mse_loss)


def train(
    case: Case,
    device: torch.device,
    steps: int,
    dtype: torch.dtype | None,
    backend: Any = None,
    split: bool = False,
    planner: str = "static",
) -> str:
    """``steps`` training steps of ``case`` wrapped (with the weight-gradient split if
    ``split``); returns a one-line account."""
    # The static plan by default: the protocol is what is checked, and it forks from the
    # first step (the dataflow planner's first step learns, inline).
    model = ooo_wrap.OOOModule(
        case.build().to(device),
        streams=4,
        backend=backend,
        planner=planner,  # type: ignore[arg-type]
        split_weight_grads=split,
        tune=False,
    )
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
        f"{case.name}, {'float32' if dtype is None else 'bfloat16 autocast'}: {steps} steps, "
        f"{len(model.plan.stages)} stages on {model.plan.num_streams} streams, "
        f"{stats.stage_calls} stage calls, {stats.waits} waits, "
        f"{stats.record_streams} record_stream calls"
        + (f", {stats.split_layer_calls} split layer calls" if split else "")
    )


def flagged(run: Callable[[], object], device: torch.device) -> str | None:
    """Run ``run``; the sanitizer's error message if it raised one, else ``None``.

    The device is synchronized afterwards either way, which the sanitizer sees: what ran
    before cannot be blamed for what runs next.
    """
    try:
        run()
    except Exception as error:
        if type(error).__name__ != SANITIZER_ERROR:
            raise
        return str(error).splitlines()[0] if str(error) else SANITIZER_ERROR
    finally:
        torch.cuda.synchronize(device)
    return None


def probe_record_stream(device: torch.device) -> bool:
    """Whether this sanitizer ignores ``record_stream`` (True) or counts it as a write."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    x = torch.ones(1 << 10, device=device)  # written on the current stream
    side.wait_stream(current)
    with torch.cuda.stream(side):
        x.mul(2)  # read on the side stream, which the current stream does not wait for
    # A correct call; a sanitizer that counts it as a write on the current stream sees
    # that write race with the side stream's read.
    return flagged(lambda: x.record_stream(side), device) is None


def toy_race(device: torch.device) -> None:
    """A two-stream program with its wait left out."""
    x = torch.rand(1 << 16, device=device)  # written on the current (default) stream
    side = torch.cuda.Stream(device)
    # The bug, on purpose: no side.wait_stream(torch.cuda.current_stream()), so the read
    # of x below may run before torch.rand has finished writing it.
    with torch.cuda.stream(side):
        x * 2


def main(argv: Sequence[str] | None = None) -> int:
    """Preflight, clean runs and broken runs; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mode", choices=("all", "clean", "broken"), default="all")
    parser.add_argument("--steps", type=int, default=2, help="training steps per clean run")
    parser.add_argument(
        "--quick", action="store_true", help="two models in float32 only (a second look)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the CUDA Stream Sanitizer check needs a CUDA GPU", file=sys.stderr)
        return EXIT_SETUP
    if "TORCH_CUDA_SANITIZER" not in os.environ:
        print(
            "error: run with TORCH_CUDA_SANITIZER=1 in the environment (torch reads it at "
            "import), e.g. TORCH_CUDA_SANITIZER=1 python3 scripts/sanitizer_check.py",
            file=sys.stderr,
        )
        return EXIT_SETUP
    device = torch.device("cuda", torch.cuda.current_device())
    ignores = probe_record_stream(device)
    print(
        "preflight: this sanitizer ignores record_stream"
        if ignores
        else "preflight: this sanitizer counts record_stream as a write on the current "
        "stream (an older CSAN): a record_stream after a fork event may be reported "
        "although it is correct",
        flush=True,
    )
    clean_ok = clean_runs = broken_ok = broken_runs = 0
    if args.mode in ("all", "clean"):
        dtypes = (None,) if args.quick else (None, torch.bfloat16)
        # Stages alone on every model; with the split too on the towers and the transformer.
        runs = [(c, d, False) for c in cases(args.quick) for d in dtypes]
        runs += [(c, d, True) for c in cases(quick=True) for d in dtypes]
        for case, dtype, split in runs:
            account: list[str] = []
            message = flagged(
                lambda c=case, d=dtype, a=account, s=split: a.append(
                    train(c, device, args.steps, d, split=s)
                ),
                device,
            )
            clean_runs += 1
            if message is None:
                clean_ok += 1
                print(f"ok: {account[0]}", flush=True)
            else:
                what = f"{case.name}{' with the split' if split else ''}"
                print(f"REPORTED (must be silent): {what}: {message}", flush=True)
    if args.mode in ("all", "broken"):
        spec = ModelSpec.towers(4, 256, 2)
        broken_backend = without_fork_wait(AcceleratorBackend)()
        races: list[tuple[str, Callable[[], object]]] = [
            ("a two-stream program without its wait", lambda: toy_race(device)),
            (
                f"{spec.label} wrapped, with the fork wait removed",
                lambda: train(_spec_case(spec, 8), device, 1, None, backend=broken_backend),
            ),
            (
                "a chain with the weight-gradient split, its dW wait removed",
                # The dataflow plan of a chain is the split alone (no stage to fork); its
                # first step learns, inline, the second splits.
                lambda: train(
                    split_chain(),
                    device,
                    2,
                    None,
                    backend=broken_backend,
                    split=True,
                    planner="dataflow",
                ),
            ),
        ]
        for name, run in races:
            message = flagged(run, device)
            broken_runs += 1
            if message is not None:
                broken_ok += 1
                print(f"flagged as it must be: {name}: {message}", flush=True)
            else:
                print(f"NOT FLAGGED (must be): {name}", flush=True)
    ok = clean_ok == clean_runs and broken_ok == broken_runs
    print(
        f"verdict: {'PASS' if ok else 'FAIL'}: {clean_ok}/{clean_runs} clean runs silent, "
        f"{broken_ok}/{broken_runs} broken runs flagged; record_stream "
        f"{'ignored' if ignores else 'counted as a write'} by this sanitizer",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
