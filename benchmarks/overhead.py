"""Host overhead of the wrapper's hooks, per stage call, with stream calls made free.

Run: ``python benchmarks/overhead.py``. A model of 24 tiny tensor-in/tensor-out stages is
run plain and wrapped (with :class:`NullBackend`, whose stream calls do nothing),
interleaved in one process after a warm-up; the median over repeats of
``(wrapped - plain) / 24`` is the Python cost the hooks add to one stage call (the root
hooks' cost included, spread over the stages). Beside them, :class:`EmptyHooks` registers
hooks that do nothing in the wrapper's layout (root pre/post, and per stage a pre/post
``functools.partial``): the µs those add per stage call is what PyTorch charges for calling
hooks at all, and the ratio of the two (target: at most 2x) measures the wrapper's own hook
code against it; ``--compare-with`` reports the empty hooks too. Device stream calls come
on top of this on a GPU and are not measured here; instead :class:`CountingBackend` counts
them: backend
calls per stage call, by method, and how many of its event records create a new event.
These use ``planner="static"``, so that every one of the 24 stages forks from the start.

The same chain wrapped with the default ``dataflow`` planner learns ``no_parallelism`` on
its first forward and then has no hook at all: :func:`measure_no_parallelism` times it
against the plain model (target: within noise of zero) and counts its backend calls.

``--overlap-forward`` times deferred joins (``OOOModule(..., overlap_forward=True)``) beside
the eager joins on three 24-stage models: the chain (each stage feeds the next directly),
the chain with a parent op between every pair of stages (the worst case: every stage's
join is intercepted by the first op after it), and 24 independent towers summed at the
end (the best case: no op between stage calls).
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import importlib.util
import inspect
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import ooo_wrap

NUM_STAGES = 24


_AMBIENT = object()


class NullBackend:
    """A backend whose stream calls cost nothing: isolates the hooks' own Python cost."""

    name = "null"

    def unsupported_reason(self, device: torch.device) -> str | None:
        return None

    def new_stream(self, device: torch.device) -> object:
        return object()

    def current_stream(self, device: torch.device) -> object:
        return _AMBIENT  # a stream object, never None: None marks a bypassed stage call

    def set_stream(self, stream: object) -> None:
        pass

    def record_event(self, stream: object, event: object = None) -> object:
        return event if event is not None else object()

    def wait_event(self, stream: object, event: object) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        pass

    def is_capturing(self, stream: object) -> bool:
        return False


class CountingBackend(NullBackend):
    """:class:`NullBackend` that counts its calls by method (``new_event``: records that
    were not given an event to re-use, i.e. created one)."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def current_stream(self, device: torch.device) -> object:
        self.calls["current_stream"] += 1
        return _AMBIENT

    def set_stream(self, stream: object) -> None:
        self.calls["set_stream"] += 1

    def record_event(self, stream: object, event: object = None) -> object:
        self.calls["record_event"] += 1
        if event is None:
            self.calls["new_event"] += 1
        return super().record_event(stream, event)

    def wait_event(self, stream: object, event: object) -> None:
        self.calls["wait_event"] += 1

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        self.calls["record_stream"] += 1

    def is_capturing(self, stream: object) -> bool:
        self.calls["is_capturing"] += 1
        return False


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList(Scale() for _ in range(NUM_STAGES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


class ParentOpChain(Chain):
    """The chain with a parent op between every pair of stages."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x) + 1.0
        return x


class Towers(Chain):
    """Independent stages on one input, summed once at the end."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [stage(x) for stage in self.stages]
        return torch.stack(outs).sum(0)


MODELS: dict[str, type[Chain]] = {
    "chain": Chain,
    "chain_parent_op": ParentOpChain,
    "towers": Towers,
}


class EmptyHooks:
    """Hooks that do nothing, registered as the wrapper registers its own: the yardstick
    for the wrapper's hooks.

    The same layout as ``Scheduler.install``: a root pre-hook (``with_kwargs``,
    ``prepend``) and post-hook (``with_kwargs``, ``always_call``), and on each stage a
    pre-hook and a post-hook (``always_call``), each a ``functools.partial`` of a function
    with the hook object and the stage bound. What PyTorch spends calling hooks at all is
    in this figure; what the wrapper's hooks add on top of it is theirs.
    """

    def root_pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        pass

    def root_post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        pass

    def stage_pre_hook(self, stage: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        pass

    def stage_post_hook(
        self, stage: int, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        pass

    def install(self, model: Chain) -> Chain:
        model.register_forward_pre_hook(self.root_pre_hook, with_kwargs=True, prepend=True)
        model.register_forward_hook(self.root_post_hook, with_kwargs=True, always_call=True)
        for index, stage in enumerate(model.stages):
            pre = functools.partial(EmptyHooks.stage_pre_hook, self, index)
            stage.register_forward_pre_hook(pre, with_kwargs=True)
            post = functools.partial(EmptyHooks.stage_post_hook, self, index)
            stage.register_forward_hook(post, with_kwargs=True, always_call=True)
        return model


def _time_forwards(model: nn.Module, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        model(x)
    return time.perf_counter() - start


def _interleaved(
    sides: dict[str, nn.Module], x: torch.Tensor, warmup: int, repeats: int, calls: int
) -> dict[str, list[float]]:
    """µs per forward of each side, per repeat: warmed up apart, then timed interleaved, so
    drift hits every side alike."""
    for model in sides.values():
        _time_forwards(model, x, warmup)
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, model in sides.items():
            times[side].append(_time_forwards(model, x, calls) / calls * 1e6)
    return times


def _added_per_stage_call(times: dict[str, list[float]], side: str) -> list[float]:
    """Per repeat, the µs ``side`` adds to the plain forward per stage call."""
    return [(t - p) / NUM_STAGES for t, p in zip(times[side], times["plain"], strict=True)]


def measure(
    repeats: int = 30,
    calls: int = 200,
    warmup: int = 200,
    *,
    profile_ranges: bool = False,
    empty_hooks: bool = False,
) -> dict[str, float]:
    """Median µs per forward (plain, wrapped) and µs added per stage call.

    With ``empty_hooks``, a third side hooked with :class:`EmptyHooks` is timed in the same
    interleaving, adding its µs per forward, the µs those add per stage call, and the
    median of the per-repeat ratios wrapped / empty (the keys without it are the ones
    ``benchmarks/suite.py`` records)."""
    plain = Chain()
    sides: dict[str, nn.Module] = {
        "plain": plain,
        "wrapped": ooo_wrap.OOOModule(
            copy.deepcopy(plain),
            backend=NullBackend(),
            profile_ranges=profile_ranges,
            planner="static",
        ),
    }
    if empty_hooks:
        sides["empty_hooks"] = EmptyHooks().install(copy.deepcopy(plain))
    times = _interleaved(sides, torch.ones(1), warmup, repeats, calls)
    added = {side: _added_per_stage_call(times, side) for side in sides if side != "plain"}
    result = {
        "plain_us_per_forward": statistics.median(times["plain"]),
        "wrapped_us_per_forward": statistics.median(times["wrapped"]),
        "added_us_per_stage_call": statistics.median(added["wrapped"]),
    }
    if empty_hooks:
        result["empty_hooks_us_per_forward"] = statistics.median(times["empty_hooks"])
        result["empty_hooks_us_per_stage_call"] = statistics.median(added["empty_hooks"])
        result["ratio_to_empty_hooks"] = statistics.median(
            w / e for w, e in zip(added["wrapped"], added["empty_hooks"], strict=True)
        )
    return result


class NullClock:
    """A step clock whose marks cost nothing and are never passed: tuning stays pending."""

    device_name = "null"

    def mark(self, stream: object) -> object:
        return object()

    def done(self, mark: object) -> bool:
        return False

    def synchronize(self, mark: object) -> None:
        pass

    def elapsed_ms(self, start: object, end: object) -> float:
        return 0.0


class TimingNullBackend(NullBackend):
    """:class:`NullBackend` with :class:`NullClock`: a wrapped model tunes on it."""

    def step_clock(self, device: torch.device) -> NullClock:
        return NullClock()


# Forwards a fresh model tunes for before its cap (the default tune_steps=6: two warm-ups
# and three rounds of six pairs), all timed while its tuning is pending.
TUNING_FORWARDS = 36


def measure_tuning(repeats: int = 30, warmup: int = 3) -> dict[str, float]:
    """Median µs per forward of the chain: plain, wrapped with ``tune=False``, and wrapped
    while measured tuning is pending (its first forwards: alternating plain and planned
    steps, a timing mark and a stream query each). Each repeat wraps fresh copies."""
    plain = Chain()
    x = torch.ones(1)

    def tuned_sides() -> tuple[nn.Module, nn.Module]:
        fixed = ooo_wrap.OOOModule(
            copy.deepcopy(plain), backend=NullBackend(), planner="static", tune=False
        )
        tuning = ooo_wrap.OOOModule(
            copy.deepcopy(plain), backend=TimingNullBackend(), planner="static", tune=True
        )
        return fixed, tuning

    for _ in range(warmup):
        for side in (plain, *tuned_sides()):
            _time_forwards(side, x, TUNING_FORWARDS)
    plain_us, fixed_us, tuning_us = [], [], []
    for _ in range(repeats):  # interleaved, fresh wrapped copies each time
        fixed, tuning = tuned_sides()
        plain_us.append(_time_forwards(plain, x, TUNING_FORWARDS) / TUNING_FORWARDS * 1e6)
        fixed_us.append(_time_forwards(fixed, x, TUNING_FORWARDS) / TUNING_FORWARDS * 1e6)
        tuning_us.append(_time_forwards(tuning, x, TUNING_FORWARDS) / TUNING_FORWARDS * 1e6)
        assert tuning.tuning is not None and tuning.tuning.decision == "pending"
    return {
        "plain_us_per_forward": statistics.median(plain_us),
        "untuned_us_per_forward": statistics.median(fixed_us),
        "tuning_us_per_forward": statistics.median(tuning_us),
    }


class ArmClock(NullClock):
    """A clock under which the ``static`` arm's steps take 8 ms and every other arm's 10:
    each mark notes the arm that ran the step it ends (read from the wrapper's state)."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None

    def mark(self, stream: object) -> object:
        from ooo_wrap._wrapper.registry import wrapped

        tuner = wrapped[self.model].tuner if self.model is not None else None
        return tuner.active.name if tuner is not None else "plain"

    def done(self, mark: object) -> bool:
        return True

    def elapsed_ms(self, start: object, end: object) -> float:
        return 8.0 if end == "static" else 10.0


class ArmClockBackend(NullBackend):
    def __init__(self) -> None:
        self.clock = ArmClock()

    def step_clock(self, device: torch.device) -> ArmClock:
        return self.clock


def measure_decided(repeats: int = 30, calls: int = 200) -> dict[str, Any]:
    """Median µs per training forward of the chain once measured tuning decided: plain,
    the model that raced its arms and kept ``static``, and the same arm pinned
    (``tune_arm="static"``, nothing raced): once decided, only the winner's hooks remain,
    so the last two should cost the same."""
    plain = Chain()
    x = torch.ones(1)
    backend = ArmClockBackend()
    raced = ooo_wrap.OOOModule(copy.deepcopy(plain), backend=backend, planner="static")
    backend.clock.model = raced
    optimizer = torch.optim.SGD(raced.parameters(), lr=0.0)
    for _ in range(200):
        raced(x).sum().backward()
        optimizer.step()
        if raced.tuning is not None and raced.tuning.decision != "pending":
            break
    assert raced.tuning is not None and raced.tuning.decision == "static", raced.tuning
    pinned = ooo_wrap.OOOModule(
        copy.deepcopy(plain), backend=NullBackend(), planner="static", tune_arm="static"
    )
    sides = {"plain": plain, "decided": raced, "pinned": pinned}
    for side in sides.values():
        _time_forwards(side, x, calls)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):  # interleaved
        for name, side in sides.items():
            times[name].append(_time_forwards(side, x, calls) / calls * 1e6)
    result: dict[str, Any] = {f"{n}_us_per_forward": statistics.median(t) for n, t in times.items()}
    result["decided_over_pinned"] = (
        result["decided_us_per_forward"] / result["pinned_us_per_forward"]
    )
    return result


def overlap_sides(plain: nn.Module) -> dict[str, nn.Module]:
    """``plain`` and two wrapped copies, eager joins and ``overlap_forward=True``, both with
    the static plan: the default ``dataflow`` planner would find these one-op stages too
    small to fork, learn ``no_parallelism`` and remove every hook, timing nothing."""
    return {
        "plain": plain,
        "eager": ooo_wrap.OOOModule(copy.deepcopy(plain), backend=NullBackend(), planner="static"),
        "overlap": ooo_wrap.OOOModule(
            copy.deepcopy(plain), backend=NullBackend(), planner="static", overlap_forward=True
        ),
    }


def measure_overlap(repeats: int = 30, calls: int = 200, warmup: int = 200) -> dict[str, Any]:
    """Per model of ``MODELS``: median µs per plain forward and µs added per stage call
    with eager joins and with ``overlap_forward=True``, all interleaved."""
    results: dict[str, Any] = {}
    x = torch.ones(1)
    for name, factory in MODELS.items():
        times = _interleaved(overlap_sides(factory()), x, warmup, repeats, calls)
        results[name] = {
            "plain_us_per_forward": statistics.median(times["plain"]),
            **{
                f"{side}_added_us_per_stage_call": statistics.median(
                    _added_per_stage_call(times, side)
                )
                for side in ("eager", "overlap")
            },
        }
    return results


def count_backend_calls(forwards: int = 100) -> dict[str, float]:
    """Backend calls per stage call, by method, in steady state (after one forward)."""
    backend = CountingBackend()
    wrapped = ooo_wrap.OOOModule(Chain(), backend=backend, planner="static")
    x = torch.ones(1)
    wrapped(x)  # first use makes the events that later calls re-use
    backend.calls.clear()
    for _ in range(forwards):
        wrapped(x)
    stage_calls = forwards * NUM_STAGES
    per_call = {name: count / stage_calls for name, count in sorted(backend.calls.items())}
    per_call["total"] = sum(v for k, v in backend.calls.items() if k != "new_event") / stage_calls
    per_call.setdefault("new_event", 0.0)
    return per_call


def measure_no_parallelism(
    repeats: int = 30, calls: int = 200, warmup: int = 200
) -> dict[str, float]:
    """The chain wrapped with the ``dataflow`` planner, after the forward that learned
    ``no_parallelism``: median µs per forward plain and wrapped, their difference, the
    spread of the plain side between repeats (the noise), and backend calls per forward."""
    plain = Chain()
    backend = CountingBackend()
    wrapped = ooo_wrap.OOOModule(copy.deepcopy(plain), backend=backend)
    x = torch.ones(1)
    wrapped(x)  # learns the plan: a chain, so nothing to overlap and every hook removed
    reasons = [event.reason for event in ooo_wrap.events_for(wrapped)]
    if "no_parallelism" not in reasons:
        raise RuntimeError(f"expected the chain to learn no_parallelism, got events {reasons}")
    backend.calls.clear()
    _time_forwards(plain, x, warmup)
    _time_forwards(wrapped, x, warmup)
    plain_us, wrapped_us, added_us = [], [], []
    for _ in range(repeats):  # interleaved A/B, so drift hits both sides alike
        a = _time_forwards(plain, x, calls) / calls * 1e6
        b = _time_forwards(wrapped, x, calls) / calls * 1e6
        plain_us.append(a)
        wrapped_us.append(b)
        added_us.append(b - a)
    forwards = warmup + repeats * calls
    quartiles = statistics.quantiles(plain_us, n=4)
    return {
        "plain_us_per_forward": statistics.median(plain_us),
        "wrapped_us_per_forward": statistics.median(wrapped_us),
        "added_us_per_forward": statistics.median(added_us),
        "plain_iqr_us": quartiles[2] - quartiles[0],
        "backend_calls_per_forward": sum(backend.calls.values()) / forwards,
    }


def _load_other(root: str) -> Any:
    """Import the ``ooo_wrap`` package under ``root`` as ``ooo_wrap_other``."""
    init = pathlib.Path(root) / "ooo_wrap" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "ooo_wrap_other", init, submodule_search_locations=[str(init.parent)]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"no ooo_wrap package under {root}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ooo_wrap_other"] = module  # its relative imports resolve through this
    spec.loader.exec_module(module)
    return module


def _wrap_static(package: Any, model: nn.Module) -> nn.Module:
    """``model`` wrapped by ``package`` with the static plan: a revision with the dataflow
    planner would learn ``no_parallelism`` on this chain and remove its hooks, timing
    nothing; one from before the planner has only the static plan."""
    if "planner" in inspect.signature(package.OOOModule.__new__).parameters:
        wrapped: nn.Module = package.OOOModule(model, backend=NullBackend(), planner="static")
    else:
        wrapped = package.OOOModule(model, backend=NullBackend())
    return wrapped


def compare(other_root: str, repeats: int = 60, calls: int = 100) -> dict[str, float]:
    """µs added per stage call by this package's hooks and by another copy's, interleaved.

    ``other_root`` holds an ``ooo_wrap`` directory, e.g. an older revision extracted with
    ``git archive <rev> ooo_wrap | tar -x -C <other_root>``.
    """
    other = _load_other(other_root)
    plain = Chain()
    models = {
        "plain": plain,
        "this": ooo_wrap.OOOModule(copy.deepcopy(plain), backend=NullBackend(), planner="static"),
        "other": _wrap_static(other, copy.deepcopy(plain)),
        "empty": EmptyHooks().install(copy.deepcopy(plain)),
    }
    times = _interleaved(models, torch.ones(1), calls, repeats, calls)
    added = {
        name: statistics.median(_added_per_stage_call(times, name))
        for name in ("this", "other", "empty")
    }
    return {
        "this_us_per_stage_call": added["this"],
        "other_us_per_stage_call": added["other"],
        "empty_hooks_us_per_stage_call": added["empty"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200, help="forwards per timed repeat")
    parser.add_argument(
        "--tuning",
        action="store_true",
        help="time forwards while measured tuning is pending against tune=False and plain",
    )
    parser.add_argument(
        "--decided",
        action="store_true",
        help="time forwards once tuning decided against the same arm pinned, and plain",
    )
    parser.add_argument(
        "--profile-ranges", action="store_true", help="wrap with profile_ranges=True"
    )
    parser.add_argument(
        "--overlap-forward",
        action="store_true",
        help="time overlap_forward=True beside eager joins on the chain, the chain with "
        "a parent op between stages, and independent towers",
    )
    parser.add_argument(
        "--compare-with",
        metavar="DIR",
        help="also time the ooo_wrap package under DIR, interleaved in this process",
    )
    args = parser.parse_args()
    if args.tuning:
        tuning = measure_tuning(args.repeats)
        print(f"torch {torch.__version__}, {NUM_STAGES} stages, median of {args.repeats} repeats")
        print(
            f"µs per forward, first {TUNING_FORWARDS} forwards: plain "
            f"{tuning['plain_us_per_forward']:.1f}, wrapped tune=False "
            f"{tuning['untuned_us_per_forward']:.1f}, wrapped while tuning "
            f"{tuning['tuning_us_per_forward']:.1f} (half its steps plain, stages inline)"
        )
        return
    if args.decided:
        decided = measure_decided(args.repeats, args.calls)
        print(f"torch {torch.__version__}, {NUM_STAGES} stages, median of {args.repeats} repeats")
        print(
            f"µs per forward once decided: plain {decided['plain_us_per_forward']:.1f}, "
            f"raced and kept static {decided['decided_us_per_forward']:.1f}, static pinned "
            f"{decided['pinned_us_per_forward']:.1f} (decided / pinned: "
            f"{decided['decided_over_pinned']:.3f})"
        )
        return
    if args.compare_with:
        both = compare(args.compare_with, args.repeats, args.calls)
        this, empty = both["this_us_per_stage_call"], both["empty_hooks_us_per_stage_call"]
        print(
            f"added per stage call: this {this:.2f} µs, "
            f"{args.compare_with} {both['other_us_per_stage_call']:.2f} µs, "
            f"empty hooks of the same layout {empty:.2f} µs (this / empty: {this / empty:.2f}x)"
        )
        return
    if args.overlap_forward:
        table = measure_overlap(args.repeats, args.calls)
        print(f"torch {torch.__version__}, {NUM_STAGES} stages, median of {args.repeats} repeats")
        print("µs added per stage call     eager joins  overlap_forward  (plain forward µs)")
        for name, row in table.items():
            print(
                f"  {name:<26}{row['eager_added_us_per_stage_call']:10.2f}"
                f"{row['overlap_added_us_per_stage_call']:17.2f}"
                f"  ({row['plain_us_per_forward']:.1f})"
            )
        return
    result = measure(args.repeats, args.calls, profile_ranges=args.profile_ranges, empty_hooks=True)
    print(f"torch {torch.__version__}, {NUM_STAGES} stages, median of {args.repeats} repeats")
    print(f"plain forward:   {result['plain_us_per_forward']:8.1f} µs")
    print(f"wrapped forward: {result['wrapped_us_per_forward']:8.1f} µs")
    print(f"empty hooks:     {result['empty_hooks_us_per_forward']:8.1f} µs (same layout)")
    print(f"added per stage call: {result['added_us_per_stage_call']:.2f} µs (target <= 10 µs)")
    print(
        f"empty hooks of the same layout, per stage call: "
        f"{result['empty_hooks_us_per_stage_call']:.2f} µs; wrapped / empty: "
        f"{result['ratio_to_empty_hooks']:.2f}x (target <= 2x)"
    )
    calls = count_backend_calls()
    detail = ", ".join(f"{k} {v:.2f}" for k, v in calls.items() if k not in ("total", "new_event"))
    print(f"backend calls per stage call: {calls['total']:.2f} ({detail})")
    print(f"events created per stage call (steady state): {calls['new_event']:.2f}")
    learned = measure_no_parallelism(args.repeats, args.calls)
    print(
        "dataflow planner, the same chain (learned no_parallelism, hooks removed): "
        f"plain {learned['plain_us_per_forward']:.1f} µs, wrapped "
        f"{learned['wrapped_us_per_forward']:.1f} µs per forward, added "
        f"{learned['added_us_per_forward']:+.2f} µs (plain's spread between repeats, "
        f"IQR: {learned['plain_iqr_us']:.2f} µs); backend calls per forward: "
        f"{learned['backend_calls_per_forward']:.0f}"
    )


if __name__ == "__main__":
    main()
