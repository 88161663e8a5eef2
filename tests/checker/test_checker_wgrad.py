"""The race checker proves the weight-gradient split (``split_weight_grads``): clean on the
models of the parity tests, eagerly and under a simulated graph capture, with
accumulators held from before the first forward (as ``DistributedDataParallel`` holds
them); and each of its synchronization points, removed, is caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

import ooo_wrap
import ooo_wrap._runtime.wgrad as wgrad_split
import ooo_wrap._runtime.wgrad_function as wgrad
from ooo_wrap.testing import CheckReport, DetectingBackend, check, detect
from ooo_wrap.testing._engine import EngineModel
from tests.runtime.test_wgrad import MLP, MODELS, mlp_input


def backward_ops_off_the_caller(report: CheckReport) -> set[str]:
    """The streams other than the caller's that ran backward ops (the weight gradients:
    these plans have no stage)."""
    return {op.stream for op in report.trace if op.phase == "backward" and op.stream_index != 0}


def lagging(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the weight-gradient stream lag by any number of layers: the virtual device
    tells no live bytes (a budget of 0, each dW caught up with at once), so say it holds
    a great many; the layers' stream then waits on no dW in backward."""
    monkeypatch.setattr(wgrad_split, "live_bytes_of", lambda backend, device: 2**62)


@pytest.mark.parametrize("lag", [False, True], ids=["caught-up", "lagging"])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_split_checks_clean(
    name: str, capture: bool, lag: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if lag:
        lagging(monkeypatch)
    make, data = MODELS[name]
    torch.manual_seed(0)
    report = check(make(), data(), split_weight_grads=True, steps=3, capture=capture)
    assert report.not_checked is None
    assert report.races == () and report.allocator_hazards == ()
    assert report.ok  # parity bitwise too
    assert len(backward_ops_off_the_caller(report)) == 1  # the weight-gradient stream


class Autocast(nn.Module):
    """``inner`` under ``torch.autocast("cpu", dtype=torch.bfloat16)``, its output float32."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out: torch.Tensor = self.inner(x)
        return out.float()


def checked_under_autocast(name: str, capture: bool = False) -> CheckReport:
    make, data = MODELS[name]
    torch.manual_seed(0)
    return check(Autocast(make()), data(), split_weight_grads=True, steps=3, capture=capture)


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("name", ["tied", "block", "conv"])
def test_the_split_under_bf16_autocast_checks_clean(name: str, capture: bool) -> None:
    # The weight's cast runs on the weight-gradient stream in forward (its backward, the
    # cast of dW back to float32, then runs there too): forked from and joined to the
    # layers' stream. The tied weight is read in float32 by the embedding and cast for the
    # head.
    report = checked_under_autocast(name, capture)
    assert report.not_checked is None
    assert report.races == () and report.allocator_hazards == ()
    assert report.ok


def test_without_the_fork_the_casts_race_with_the_optimizer_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wgrad, "_fork_casts", lambda backend, stream, ambient: None)
    report = checked_under_autocast("tied")
    assert any(
        race.later.stream != "default" and race.earlier.phase == "step" for race in report.races
    ), report.races


def test_without_the_join_the_layer_reads_unfinished_casts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def protect_only(backend: Any, stream: Any, ambient: Any, casts: Any) -> None:
        wgrad._protect(backend, casts, ambient)

    monkeypatch.setattr(wgrad, "_join_casts", protect_only)
    report = checked_under_autocast("tied")
    assert any(
        race.later.stream == "default" and race.earlier.stream != "default" for race in report.races
    ), report.races
    assert not report.allocator_hazards


def test_without_record_stream_the_allocator_may_reuse_the_casts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def wait_only(backend: Any, stream: Any, ambient: Any, casts: Any) -> None:
        backend.wait_event(ambient, backend.record_event(stream))

    monkeypatch.setattr(wgrad, "_join_casts", wait_only)
    report = checked_under_autocast("tied")
    assert report.allocator_hazards and not report.races


def test_accumulators_held_from_before_the_first_forward() -> None:
    # As DDP does: each parameter's AccumulateGrad is made (on the caller's stream) and
    # held before the first forward, so the pass-through node is not its first use.
    torch.manual_seed(0)
    backend = DetectingBackend()
    with detect(backend) as found:
        model = ooo_wrap.OOOModule(MLP(), backend=backend, split_weight_grads=True, tune=False)
        found.keep_alive(model)
        held = [get_gradient_edge(p).node for p in model.parameters()]
        x = mlp_input()
        for _ in range(3):
            model(x).square().mean().backward()
            found.keep_alive(*(p.grad for p in model.parameters() if p.grad is not None))
            with found.phase("step"), torch.no_grad():
                for p in model.parameters():
                    assert p.grad is not None
                    p.sub_(p.grad, alpha=0.1)
                    p.grad = None
    assert model.stats.split_layer_calls == 6
    assert found.ok, (found.races, found.allocator_hazards)
    assert all(
        get_gradient_edge(p).node is node for p, node in zip(model.parameters(), held, strict=True)
    )
    # The held accumulators run on the caller's stream, handed dW from the weight stream.
    assert {(m.producer.id, m.accumulator.id) for m in found.accumulator_mismatches} == {(1, 0)}


def checked_mlp(monkeypatch: pytest.MonkeyPatch | None = None) -> CheckReport:
    """The MLP checked; with ``monkeypatch``, its weight-gradient stream lagging (where
    the layers' stream catches up with each dW at once, that wait orders much else)."""
    if monkeypatch is not None:
        lagging(monkeypatch)
    torch.manual_seed(0)
    return check(MLP(), mlp_input(), split_weight_grads=True, steps=2)


def test_without_the_event_wait_the_weight_gradient_races(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wgrad, "_order_after", lambda backend, stream, ambient: None)
    report = checked_mlp(monkeypatch)
    assert report.races
    assert all(race.later.stream != "default" for race in report.races[:1])


def test_with_the_pass_through_on_the_callers_stream_the_accumulation_races(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wgrad, "_handoff_stream", lambda stream, ambient: ambient)
    report = checked_mlp(monkeypatch)
    assert report.races


def test_without_record_stream_the_allocator_may_reuse_what_dw_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wgrad, "_protect", lambda backend, tensors, stream: None)
    report = checked_mlp(monkeypatch)
    assert report.allocator_hazards and not report.races


def test_without_the_end_of_backward_join_the_step_reads_unfinished_grads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine's own wait of the caller's stream on leaf streams is what orders .grad,
    # accumulated on the weight-gradient stream, before the optimizer reads it.
    original = EngineModel._end

    def end_without_leaf_waits(self: EngineModel, frame: object) -> None:
        frame.leaf_streams = set()  # type: ignore[attr-defined]
        frame.unrun = {}  # type: ignore[attr-defined]
        original(self, frame)  # type: ignore[arg-type]

    monkeypatch.setattr(EngineModel, "_end", end_without_leaf_waits)
    report = checked_mlp(monkeypatch)
    assert any(race.later.phase == "step" for race in report.races)


def unfinished_dw_behind_the_layers(report: CheckReport) -> list[int]:
    """The backward ops of the layers' stream (the caller's) issued while an earlier op of
    the weight-gradient stream was not yet ordered before them, by the checker's clocks."""
    late = []
    launched = 0  # the weight-gradient stream's ops so far, in program order
    for op in report.trace:
        clock = dict(op.clock)
        if op.stream_index == 1:
            launched = clock[1]
        elif op.stream_index == 0 and op.phase == "backward" and clock.get(1, 0) < launched:
            late.append(op.seq)
    return late


def test_the_layer_stream_waits_on_each_dw_within_the_budget() -> None:
    # Memory: the virtual device tells no live bytes, so the budget is 0 and the layers'
    # stream catches up with each dW once it is launched: by the checker's vector clocks,
    # every later op of the layers' stream is ordered after every dW issued before it.
    report = checked_mlp()
    assert report.ok and backward_ops_off_the_caller(report)
    assert unfinished_dw_behind_the_layers(report) == []


def test_without_the_catch_up_wait_the_weight_gradient_stream_lags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(wgrad, "_catch_up", lambda backend, ambient, events: None)
    report = checked_mlp()
    assert report.ok  # no race: the lag costs memory, not correctness (record_stream)
    assert unfinished_dw_behind_the_layers(report)


def test_a_chain_proves_the_split_alone_unless_the_split_is_off() -> None:
    # The tuner may keep the split alone on a chain ("auto"), so check() proves it; with
    # the split off the chain has no arm but plain, and nothing can race.
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    report = check(chain, torch.randn(2, 4))
    assert report.ok and report.arms == ("wgrad",), str(report)
    off = check(chain, torch.randn(2, 4), split_weight_grads=False)
    assert off.ok and off.arms == () and off.runs_plain is not None
