"""Random models from a small grammar pass check() with bitwise parity.

Checked with the static plan (round-robin, and with every layer named as a stage) and with
the plan the dataflow planner learns on the first step.

Grammar: a stem, then layers (a block, a residual block, parallel branches merged by sum or
concat, a stage used twice), then a head (a tensor, a tuple, or a ModuleDict of heads
returned as a dict). Blocks: linear+tanh, an MLP with dropout, a block called with a
keyword argument, and a block that runs ``torch.utils.checkpoint`` inside. Optionally the
whole forward runs under CPU autocast to bfloat16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import ooo_wrap
from ooo_wrap.testing import CheckReport, check
from tests.support.edges import count_edges
from tests.support.reference import FREE_FORK

WIDTH = 8
BLOCKS = ("linear", "mlp", "kwargs", "checkpoint")
LAYERS = ("block", "residual", "parallel", "twice")


class Scaled(nn.Module):
    """A block whose stage is called with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.linear(x) * scale


class Checkpointed(nn.Module):
    """A block that recomputes its inside during backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


def _block(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * WIDTH, WIDTH)
        )
    if kind == "kwargs":
        return Scaled()
    return Checkpointed()


def _call(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = block(x, scale=0.5) if isinstance(block, Scaled) else block(x)
    return out


@dataclass(frozen=True)
class Spec:
    layers: tuple[tuple[str, tuple[str, ...], str], ...]  # (layer, block kinds, merge)
    head: str  # tensor | tuple | dict
    autocast: bool
    streams: int


class GrammarModel(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList()
        for layer, kinds, merge in spec.layers:
            if layer == "parallel":
                branches = nn.ModuleList(_block(kind) for kind in kinds)
                entry = nn.ModuleDict({"branches": branches})
                if merge == "cat":
                    entry["proj"] = nn.Linear(WIDTH * len(kinds), WIDTH)
                self.layers.append(entry)
            else:
                self.layers.append(_block(kinds[0]))
        if spec.head == "dict":
            self.heads = nn.ModuleDict(
                {"logits": nn.Linear(WIDTH, 3), "value": nn.Linear(WIDTH, 1)}
            )
        elif spec.head == "tuple":
            self.heads = nn.ModuleDict({"0": nn.Linear(WIDTH, 3), "1": nn.Linear(WIDTH, 2)})

    def forward(self, x: torch.Tensor) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.spec.autocast):
            h = self.stem(x)
            for (layer, _, merge), module in zip(self.spec.layers, self.layers, strict=True):
                h = self._layer(layer, merge, module, h)
            if self.spec.head == "tensor":
                return h
            outputs = {name: head(h) for name, head in self.heads.items()}
            return outputs if self.spec.head == "dict" else tuple(outputs.values())

    @staticmethod
    def _layer(layer: str, merge: str, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if layer == "block":
            return _call(module, h)
        if layer == "residual":
            return h + _call(module, h)
        if layer == "twice":
            return _call(module, _call(module, h))
        assert isinstance(module, nn.ModuleDict)
        outs = [_call(branch, h) for branch in module["branches"]]
        if merge == "cat":
            return module["proj"](torch.cat(outs, dim=-1))
        return torch.stack(outs).sum(0)


_layer = st.one_of(
    st.tuples(
        st.sampled_from(["block", "residual", "twice"]), st.tuples(st.sampled_from(BLOCKS))
    ).map(lambda t: (t[0], t[1], "")),
    st.tuples(
        st.just("parallel"),
        st.lists(st.sampled_from(BLOCKS), min_size=2, max_size=3).map(tuple),
        st.sampled_from(["sum", "cat"]),
    ),
)
specs = st.builds(
    Spec,
    layers=st.lists(_layer, min_size=1, max_size=3).map(tuple),
    head=st.sampled_from(["tensor", "tuple", "dict"]),
    autocast=st.booleans(),
    streams=st.integers(min_value=1, max_value=4),
)

_settings = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def examples(sample: int, exhaustive: int) -> list[Any]:
    """How many models a test draws: ``sample`` in the default run, ``exhaustive`` (the
    same test over more of the grammar) under ``pytest -m slow``."""
    return [
        pytest.param(sample, id=f"{sample}-models"),
        pytest.param(exhaustive, id=f"{exhaustive}-models", marks=pytest.mark.slow),
    ]


def draw(body: Callable[..., None], models: int, **strategies: Any) -> None:
    """Run ``body`` on ``models`` draws of ``strategies`` (the same draws every run)."""
    settings(_settings, max_examples=models)(given(**strategies)(body))()


@pytest.mark.parametrize("models", examples(40, 110))
def test_random_models_pass_with_bitwise_parity(models: int) -> None:
    draw(_passes_with_bitwise_parity, models, spec=specs)


def _passes_with_bitwise_parity(spec: Spec) -> None:
    torch.manual_seed(0)
    model = GrammarModel(spec)
    x = torch.randn(4, WIDTH)
    report = check(model, x, streams=spec.streams, steps=2, planner="static", tune_arm="static")
    assert report.ok, f"{spec}\n{report}"
    assert report.parity and all(entry.max_abs_diff == 0.0 for entry in report.parity)
    used = {row.stream for row in report.ops if row.forward and row.stream != "default"}
    assert len(used) == min(spec.streams, len(ooo_wrap.plan(model).stages)), str(report)


@pytest.mark.parametrize("models", examples(15, 30))
def test_random_models_pass_with_deferred_joins(models: int) -> None:
    """The same grammar under overlap_forward: every stage's join left pending until its
    output is touched (a parent op, the next stage, the end of the forward)."""
    draw(_passes_with_deferred_joins, models, spec=specs)


def _passes_with_deferred_joins(spec: Spec) -> None:
    torch.manual_seed(0)
    model = GrammarModel(spec)
    x = torch.randn(4, WIDTH)
    # The stage arms (the split is proved by its own tests).
    report = check(model, x, streams=spec.streams, overlap_forward=True, split_weight_grads=False)
    _assert_ok_or_runs_plain(report, spec)
    assert all(name.endswith("+overlap") for name in report.arms), str(report)


def _assert_ok_or_runs_plain(report: CheckReport, spec: Spec) -> None:
    """Every arm clean with bitwise parity, or (no stage arm: the stages form a chain) the
    model runs plain and the report says so."""
    assert report.ok, f"{spec}\n{report}"
    if report.runs_plain is not None:
        assert report.arms == () and report.runs_plain.startswith("the model runs plain")
    else:
        assert report.parity and all(entry.exact for entry in report.parity), str(report)


@pytest.mark.parametrize("models", examples(40, 110))
def test_random_models_with_a_custom_loss_and_explicit_stages(models: int) -> None:
    steps = st.integers(min_value=1, max_value=3)
    draw(_custom_loss_passes, models, spec=specs, steps=steps)


def _custom_loss_passes(spec: Spec, steps: int) -> None:
    torch.manual_seed(1)
    model = GrammarModel(spec)
    stages = ["stem"]
    for i, layer in enumerate(model.layers):
        if isinstance(layer, nn.ModuleDict):  # forward never calls it: name what it calls
            stages += [f"layers.{i}.branches.{j}" for j in range(len(layer["branches"]))]
            stages += [f"layers.{i}.proj"] if "proj" in layer else []
        else:
            stages.append(f"layers.{i}")

    def loss_fn(output: Any) -> torch.Tensor:
        tensors = output.values() if isinstance(output, dict) else output
        tensors = [output] if isinstance(output, torch.Tensor) else list(tensors)
        return sum((t.float().pow(2).mean() for t in tensors), torch.zeros(()))

    x = torch.randn(3, WIDTH)
    report = check(
        model, x, loss_fn=loss_fn, stages=stages, steps=steps, planner="static", tune_arm="static"
    )
    assert report.ok, f"{spec}\n{report}"
    assert report.steps == steps


# Structure only: these models are far too small for any fork to pay on a real GPU, so the
# learner's reference GPU gets a near-free fork; the plan it learns is then checked as is.
@pytest.mark.parametrize("models", examples(25, 60))
def test_random_models_pass_with_the_learned_plan(models: int) -> None:
    draw(_learned_plan_passes, models, spec=specs)


def _learned_plan_passes(spec: Spec) -> None:
    torch.manual_seed(2)
    model = GrammarModel(spec)
    x = torch.randn(4, WIDTH)
    learned = ooo_wrap.plan(model, spec.streams, example_inputs=(x,), gpu=FREE_FORK)
    # The arm of the learned plan (regions) where it has stages, else every stage arm.
    arm = "regions" if learned.stages else None
    options = {"streams": spec.streams, "steps": 3, "gpu": FREE_FORK}
    report = check(model, x, split_weight_grads=False, tune_arm=arm, **options)  # type: ignore[arg-type]
    assert learned.learned is not None
    edges = count_edges(learned.learned, learned.learned.stage_streams)
    assert edges.chain_splits == 0, f"{spec}\n{learned}"
    _assert_ok_or_runs_plain(report, spec)
    if arm is not None:
        used = {row.stream for row in report.ops if row.forward and row.stream != "default"}
        assert len(used) == learned.num_streams, f"{spec}\n{learned}\n{report}"
    has_parallel = any(layer == "parallel" for layer, _, _ in spec.layers)
    if not has_parallel:
        assert not learned.learned.regions or learned.stages, str(learned)
