"""check()'s contract and CheckReport: verdict, text, error, trace, parity, caller untouched."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap._wrapper.options import Planner
from ooo_wrap.testing import (
    CheckFailed,
    CheckReport,
    ParityEntry,
    VirtualEvent,
    VirtualStream,
    check,
)
from ooo_wrap.testing import _check as check_module
from ooo_wrap.testing._parity import max_abs_diff
from tests.support.reference import FREE_FORK


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Tanh())
        self.right = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": self.left(x) + self.right(x), "right": self.right(x)}


def test_a_correct_model_gets_an_ok_report() -> None:
    report = check(Towers(), torch.randn(3, 6), planner="static", tune_arm="static")
    assert report.ok
    report.raise_if_failed()
    names = {entry.name for entry in report.parity}
    assert {"output['sum']", "output['right']", "grad:left.0.weight", "grad:right.bias"} <= names
    streams = {row.stream: row for row in report.ops}
    assert set(streams) == {"default", "side1", "side2"}
    assert streams["side1"].forward > 0 and streams["side1"].backward > 0
    assert streams["default"].step > 0
    text = str(report)
    assert text.startswith("ooo_wrap check: OK (2 steps; 0 races")
    assert "side2" in text and "enabled/simulated" in text


def test_the_callers_model_inputs_and_random_state_are_untouched() -> None:
    model = Towers()
    x = torch.randn(3, 6, requires_grad=True)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    check(model, x, planner="static")
    assert type(model) is Towers and not isinstance(model, ooo_wrap.OOOModule)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and x.grad is None
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert ooo_wrap.events_for(model) == ()


def test_a_failed_report_raises_an_ooo_error_and_reads_well() -> None:
    report = _racy_report()
    assert not report.ok
    with pytest.raises(ooo_wrap.OOOError) as caught:
        report.raise_if_failed()
    assert isinstance(caught.value, CheckFailed)
    message = str(caught.value)
    assert message.startswith("ooo_wrap check: FAILED")
    assert "race: read-after-write: read by aten.relu.default on default (forward)" in message
    assert "stage 'a'" in message


def _racy_report() -> CheckReport:
    """A scheduler without the ambient join: a parent op reads an unfinished stage."""

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).relu())

    class NoJoin(check_module.DetectingBackend):
        def wait_event(self, stream: VirtualStream, event: VirtualEvent) -> None:
            if stream.id != 0:  # drop every join into the caller's stream
                super().wait_event(stream, event)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(check_module, "DetectingBackend", NoJoin)
        return check(Chain(), torch.randn(2, 4), planner="static", tune_arm="static")


def test_save_trace_writes_one_track_per_stream_in_stream_order(tmp_path: Path) -> None:
    report = check(Towers(), torch.randn(3, 6), planner="static", tune_arm="static")
    path = tmp_path / "trace.json"
    report.save_trace(path)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tracks = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert tracks == {0: "default", 1: "side1", 2: "side2"}
    assert len(slices) == len(report.trace)
    for tid in tracks:  # each stream runs its ops in order, one at a time
        track = [e for e in slices if e["tid"] == tid]
        assert all(b["ts"] >= a["ts"] + a["dur"] for a, b in itertools.pairwise(track))
    assert all({"name", "pid", "tid", "ts", "dur"} <= set(e) for e in slices)
    assert {e["cat"] for e in slices} == {"forward", "backward", "step"}
    assert {e["args"]["stage"] for e in slices if e["tid"] == 1} == {"left"}


def test_parity_entries_flag_differences() -> None:
    assert ParityEntry("output", 0.0).exact
    assert not ParityEntry("output", 1e-7).exact
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert max_abs_diff(a, a.clone()) == 0.0
    assert max_abs_diff(a, torch.tensor([1.0, float("nan"), 3.5])) == 0.5
    assert max_abs_diff(a, torch.tensor([1.0, 2.0, 3.0])) == math.inf
    assert max_abs_diff(a, None) == math.inf
    assert max_abs_diff(a, a.double()) == math.inf


class SparseTowers(nn.Module):
    """Two embedding tables with sparse gradients (sparse COO ``.grad``)."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Embedding(10, 4, sparse=True)
        self.right = nn.Embedding(10, 4, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.left(ids) * self.right(ids)


# These models are far too small for a fork to pay on a real GPU: with the dataflow planner
# the learner's reference GPU gets a near-free fork, so that a plan is learned and checked.
@pytest.mark.parametrize("planner", ["static", "dataflow"])
def test_sparse_gradients_are_compared(planner: Planner) -> None:
    report = check(SparseTowers(), torch.randint(0, 10, (3, 5)), planner=planner, gpu=FREE_FORK)
    assert report.ok, str(report)
    assert {"grad:left.weight", "grad:right.weight"} <= {entry.name for entry in report.parity}


def test_sparse_parity_compares_values_and_layout() -> None:
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    sparse = dense.to_sparse()
    uncoalesced = torch.sparse_coo_tensor(
        [[1, 0, 1], [0, 1, 0]], [1.5, 1.0, 0.5], (2, 2), check_invariants=True
    )
    assert max_abs_diff(sparse, uncoalesced) == 0.0  # same values
    assert max_abs_diff(sparse, (dense * 2).to_sparse()) == 2.0
    assert max_abs_diff(sparse, dense) == math.inf  # another layout


class Masked(nn.Module):
    """Keyword inputs, as Hugging Face models take them: ``model(ids, attention_mask=m)``."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(6, 6)
        self.right = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return (self.left(x) * mask + self.right(x) * scale).tanh()


@pytest.mark.parametrize("planner", ["static", "dataflow"])
def test_check_takes_keyword_inputs(planner: Planner) -> None:
    x, mask = torch.randn(3, 6), torch.ones(3, 6, requires_grad=True)
    kwargs = {"mask": mask, "scale": 0.5}
    report = check(Masked(), x, example_kwargs=kwargs, planner=planner, gpu=FREE_FORK)
    assert report.ok, str(report)
    assert report.not_checked is None
    assert mask.grad is None and kwargs == {"mask": mask, "scale": 0.5}  # the caller's
    with pytest.raises(TypeError, match="mask"):
        check(Masked(), x, planner=planner)  # the forward needs it: the model's own error


def test_check_rejects_bad_arguments() -> None:
    wrapped = ooo_wrap.OOOModule(
        Towers(), backend=ooo_wrap.testing.SimulatedBackend(), planner="static"
    )
    with pytest.raises(ooo_wrap.OOOConfigError, match="unwrap"):
        check(wrapped, torch.randn(3, 6), planner="static")
    with pytest.raises(ooo_wrap.OOOConfigError, match="steps"):
        check(Towers(), torch.randn(3, 6), steps=0, planner="static")
    with pytest.raises(ooo_wrap.OOOConfigError, match="loss_fn"):
        check(
            nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6)).requires_grad_(False),
            torch.ones(1, 6),
            planner="static",
        )


@pytest.mark.parametrize(
    ("planner", "reason"), [("static", "too_few_stages: "), ("dataflow", "no candidate arm: ")]
)
def test_a_model_with_no_arm_but_plain_is_ok_and_says_why(planner: Planner, reason: str) -> None:
    # Falling back at wrap time and having no candidate arm both leave the model running
    # plain, with no side stream: nothing can race, so the report is ok and says why.
    chain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    model = nn.Sequential(nn.Linear(6, 6)) if planner == "static" else chain
    report = check(model, torch.randn(2, 6), planner=planner, split_weight_grads=False)
    assert report.ok and report.not_checked is None and report.arms == ()
    assert report.runs_plain is not None
    assert report.runs_plain.startswith(f"the model runs plain ({reason}")
    assert report.runs_plain.endswith(
        "so nothing runs on a side stream and nothing can race: no arm to check"
    )
    assert str(report) == f"ooo_wrap check: OK: {report.runs_plain}"
    report.raise_if_failed()
    assert report.races == report.allocator_hazards == report.ops == ()


def test_a_model_checked_only_on_its_learning_step_is_not_ok() -> None:
    chain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    report = check(chain, torch.randn(2, 6), steps=1)
    assert report.arms == ("wgrad",) and report.not_checked is not None and not report.ok
    assert str(report) == f"ooo_wrap check: NOT CHECKED: {report.not_checked}"
    assert "pass steps >= 2" in report.not_checked
    with pytest.raises(CheckFailed, match="NOT CHECKED"):
        report.raise_if_failed()


def test_a_wrapped_model_is_checked() -> None:
    report = check(Towers(), torch.randn(3, 6), planner="static")
    assert report.not_checked is None
    assert report.ok, str(report)


def test_the_verdict_counts_in_the_singular_and_plural() -> None:
    report = check(Towers(), torch.randn(3, 6), steps=1, planner="static", tune_arm="static")
    assert str(report).splitlines()[0] == (
        "ooo_wrap check: OK (1 step; 0 races, 0 allocator hazards, 0 parity mismatches)"
    )


def test_the_verdict_says_the_forward_joins_were_deferred() -> None:
    plain = check(Towers(), torch.randn(3, 6), planner="static", tune_arm="static")
    assert not plain.overlap_forward and "deferred" not in str(plain)
    arm = "static+overlap"
    report = check(
        Towers(), torch.randn(3, 6), planner="static", overlap_forward=True, tune_arm=arm
    )
    assert report.ok and report.overlap_forward, str(report)
    assert str(report).startswith("ooo_wrap check: OK (2 steps, forward joins deferred; 0 races")
    both = check(
        Towers(),
        torch.randn(3, 6),
        planner="static",
        overlap_forward=True,
        capture=True,
        tune_arm=arm,
    )
    assert str(both).startswith(
        "ooo_wrap check: OK (2 steps, the last one under simulated graph capture, "
        "forward joins deferred; 0 races"
    )
