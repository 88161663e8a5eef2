"""Activation checkpointing inside and around a stage, and an autocast + GradScaler loop:
bitwise parity with the plain model (same CPU kernels in the same order; virtual streams
change no arithmetic)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ooo_wrap
from ooo_wrap._runtime import recompute as _recompute
from ooo_wrap._runtime import scheduler as scheduler_module
from ooo_wrap.testing import DetectingBackend, SimulatedBackend, check, detect
from ooo_wrap.testing._simulated import DEFAULT_STREAM
from tests.support.reference import FREE_FORK

STEPS = 3


class Tower(nn.Module):
    """A stage whose body may be checkpointed from inside its own forward."""

    def __init__(self, inner_checkpoint: bool, use_reentrant: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8))
        self.inner_checkpoint = inner_checkpoint
        self.use_reentrant = use_reentrant

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.inner_checkpoint:
            out: torch.Tensor = checkpoint(self.body, h, use_reentrant=self.use_reentrant)
            return out
        return self.body(h)


class Net(nn.Module):
    """stem -> (left, right): three stages; ``where`` says what is checkpointed.

    ``"inside"``: ``left`` checkpoints its own body; ``"around"``: the parent checkpoints
    the whole ``left`` stage call, so its hooks run again in backward; ``"none"``: neither.
    Dropout makes the recomputation depend on the RNG state checkpoint restores.
    """

    def __init__(self, where: str = "none", use_reentrant: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(12, 16), nn.ReLU())
        self.left = Tower(where == "inside", use_reentrant)
        self.right = Tower(False, use_reentrant)
        self.where = where
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        if self.where == "around":
            left: torch.Tensor = checkpoint(self.left, h, use_reentrant=self.use_reentrant)
        else:
            left = self.left(h)
        return left * self.right(h)


def _pair(where: str, use_reentrant: bool) -> tuple[nn.Module, nn.Module, SimulatedBackend]:
    torch.manual_seed(0)
    plain = Net(where, use_reentrant)
    torch.manual_seed(0)
    backend = SimulatedBackend()
    wrapped = ooo_wrap.OOOModule(
        Net(where, use_reentrant), streams=2, backend=backend, planner="static"
    )
    return plain, wrapped, backend


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for p in model.parameters() for t in (p, p.grad) if t is not None]


def _train_checkpointed(model: nn.Module, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    torch.manual_seed(seed)  # same dropout masks for both models
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        out = model(torch.randn(5, 12).to(device))
        out.square().mean().backward()
        seen += [out.detach().clone(), *_state(model)]
        optimizer.step()
    return seen


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("where", ["inside", "around"])
def test_checkpoint_keeps_bitwise_parity(where: str, use_reentrant: bool) -> None:
    plain, wrapped, backend = _pair(where, use_reentrant)
    expected = _train_checkpointed(plain, seed=1)
    got = _train_checkpointed(wrapped, seed=1)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # Checkpointing around a stage re-runs its forward (and so its hooks) in backward,
    # on a side stream again; inside one, only the stage's body is recomputed.
    recomputed = STEPS if where == "around" else 0
    stats = wrapped.stats
    assert (stats.forwards, stats.stage_calls) == (STEPS, 3 * STEPS + recomputed)
    assert stats.bypasses == stats.failures == 0
    # Every stream switch, recomputation included, was undone.
    assert backend.current_stream() == DEFAULT_STREAM
    assert ooo_wrap.events_for(wrapped)[-1].kind is ooo_wrap.EventKind.ENABLED


def _switches(backend: SimulatedBackend) -> list[object]:
    return [call.stream for call in backend.log if call.op == "set_stream"]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_stage_recomputes_on_its_side_stream(use_reentrant: bool) -> None:
    _plain, wrapped, backend = _pair("around", use_reentrant)
    backend.clear_log()
    out = wrapped(torch.randn(5, 12))
    # Forward: stem, left, right, each switched to and back.
    stem, _, left, _, right, _ = _switches(backend)
    assert stem == right != left != DEFAULT_STREAM
    backend.clear_log()
    out.sum().backward()
    assert _switches(backend) == [left, DEFAULT_STREAM]  # only the recomputed stage
    # Non-reentrant checkpoint stops recomputing early by raising through the stage: that
    # is control flow, not a failure, so no STAGE_FAILED event and no failure counted.
    assert wrapped.stats.failures == 0
    assert all(e.kind is not ooo_wrap.EventKind.STAGE_FAILED for e in wrapped.events)


class Mixed(nn.Module):
    """Two towers, one with a LayerNorm (autocast runs it in float32), summed."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(12, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
        self.b = nn.Sequential(nn.Linear(12, 32), nn.SiLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def _amp_loop(
    model: nn.Module, device: str = "cpu"
) -> tuple[list[torch.Tensor], list[float], list[torch.dtype]]:
    """The usual loop: autocast forward, scaled backward, scaler.step / update."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    seen: list[torch.Tensor] = []
    scales: list[float] = []
    dtypes: list[torch.dtype] = []
    generator = torch.Generator().manual_seed(3)
    for step in range(4):
        x = torch.randn(6, 12, generator=generator).to(device)
        if step == 2:
            x[0, 0] = float("inf")  # an overflow: the scaler must skip this step
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(x)
            loss = out.float().square().mean()
        dtypes.append(out.dtype)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        seen += [out.detach().clone(), *_state(model)]
    return seen, scales, dtypes


def test_autocast_and_grad_scaler_loop_keeps_bitwise_parity() -> None:
    torch.manual_seed(0)
    plain = Mixed()
    torch.manual_seed(0)
    wrapped = ooo_wrap.OOOModule(Mixed(), streams=2, backend=SimulatedBackend(), planner="static")
    assert torch.amp.GradScaler("cpu").is_enabled()  # supported on the CPU: not a no-op
    expected, expected_scales, expected_dtypes = _amp_loop(plain)
    got, scales, dtypes = _amp_loop(wrapped)
    # Bitwise; the overflow step's outputs and gradients hold inf/NaN in both models.
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert scales == expected_scales
    assert scales[2] < scales[1]  # the inf step was skipped and the scale backed off
    assert dtypes == expected_dtypes == [torch.bfloat16] * 4
    assert wrapped.stats.stage_calls == 2 * 4


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("where", ["inside", "around"])
def test_checkpointed_model_passes_the_race_check(where: str, use_reentrant: bool) -> None:
    # The recomputation runs in backward: every op of it must still be ordered on the
    # virtual streams (vector clocks), with record_stream where tensors cross streams.
    model = Net(where, use_reentrant)
    report = check(model, torch.randn(5, 12), streams=2, planner="static", tune_arm="static")
    assert report.ok, str(report)
    # After each backward the caller's stream is current again: the SGD step (one add_
    # per parameter) runs there, and nothing after backward is labelled backward.
    rows = {row.stream: row for row in report.ops}
    assert set(rows) == {"default", "side1", "side2"}
    assert rows["default"].step == report.steps * len(list(model.parameters()))
    assert rows["side1"].step == rows["side2"].step == 0
    assert rows["side1"].forward > 0 and rows["side1"].backward > 0
    assert rows["side2"].forward > 0 and rows["side2"].backward > 0
    steps = [r for r in report.trace if r.phase == "step"]
    assert {r.op for r in steps} == {"aten.add_.Tensor"}


def test_autocast_model_passes_the_race_check() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = check(Mixed(), torch.randn(5, 12), streams=2, planner="static", tune_arm="static")
    assert report.ok, str(report)


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["inside", "around"])
def test_checkpoint_on_gpu_matches_plain(where: str) -> None:
    torch.manual_seed(0)
    plain = Net(where).cuda()
    torch.manual_seed(0)
    wrapped = ooo_wrap.OOOModule(Net(where).cuda(), streams=2, planner="static")
    assert wrapped.events[-1].kind is ooo_wrap.EventKind.ENABLED
    expected = _train_checkpointed(plain, seed=1, device="cuda")
    got = _train_checkpointed(wrapped, seed=1, device="cuda")
    torch.testing.assert_close(got, expected)
    assert wrapped.stats.failures == 0


@pytest.mark.cuda
def test_autocast_and_grad_scaler_on_gpu_match_plain() -> None:
    torch.manual_seed(0)
    plain = Mixed().cuda()
    torch.manual_seed(0)
    wrapped = ooo_wrap.OOOModule(Mixed().cuda(), streams=2, planner="static")
    assert wrapped.events[-1].kind is ooo_wrap.EventKind.ENABLED
    expected, expected_scales, _ = _amp_loop(plain, "cuda")
    got, scales, _ = _amp_loop(wrapped, "cuda")
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert scales == expected_scales


class TiedAcrossStages(nn.Module):
    """One weight used by two stages: autocast caches its low-precision copy once.

    The autocast region is the forward, as PyTorch recommends (one region per step).
    """

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 12)
        self.b = nn.Linear(12, 12)
        self.b.weight = self.a.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (self.a(x).relu() + self.b(x)).float()


def test_autocast_weight_tied_across_stages_passes_the_race_check() -> None:
    # Without care the copy cast in stage a (on its stream) is read by stage b on another
    # stream, and freed into a's pool while b's backward may still read it.
    x = torch.randn(5, 12)
    report = check(TiedAcrossStages(), x, streams=2, planner="static", tune_arm="static")
    assert report.ok, str(report)


def test_without_sharing_a_stream_the_tied_autocast_copy_is_a_hazard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_module, "pair_tied_stages", lambda model, stages: False)
    report = check(TiedAcrossStages(), torch.randn(5, 12), streams=2, planner="static")
    assert any(
        (h.allocated_on, h.access.stream, h.access.stage) == ("side1", "side2", "b")
        for h in report.allocator_hazards
    ), str(report)


def test_autocast_weight_tied_across_stages_keeps_bitwise_parity() -> None:
    torch.manual_seed(0)
    plain = TiedAcrossStages()
    wrapped = ooo_wrap.OOOModule(
        copy.deepcopy(plain), streams=2, backend=SimulatedBackend(), planner="static"
    )
    x = torch.randn(5, 12)
    out, expected = wrapped(x), plain(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(wrapped.a.weight.grad, plain.a.weight.grad, rtol=0, atol=0)


# These models are far too small for a fork to pay on a real GPU: the learner's reference
# GPU gets a near-free fork (FREE_FORK), so that the dataflow planner puts the branches on
# streams.


def _tower() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))


class CheckpointedBranches(nn.Module):
    """A checkpointed region whose branches are stages, then a head outside it.

    Two stages: ``a(x).tanh() + b(x)``; three: ``a(x) * b(x) + c(x)``. In both, the first
    backward node to unpack a saved tensor of the region is the last stage's, so the
    recomputation runs on that stage's stream, while the region's own ops (``tanh``,
    ``*``) saved tensors that their nodes read on the caller's stream.
    """

    def __init__(self, branches: int) -> None:
        super().__init__()
        self.names = ["a", "b", "c"][:branches]
        for name in self.names:
            self.add_module(name, _tower())
        self.head = nn.Linear(16, 4)

    def region(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.names) == 2:
            return self.a(x).tanh() + self.b(x)
        return self.a(x) * self.b(x) + self.c(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.region, x, use_reentrant=False)
        return self.head(out)


def _check_branches(
    branches: int, planner: str, overlap_forward: bool = False, steps: int = 3
) -> ooo_wrap.testing.CheckReport:
    torch.manual_seed(0)
    model = CheckpointedBranches(branches)
    stages = model.names if planner == "static" else None
    return check(
        model,
        torch.randn(8, 16),
        streams=3,
        stages=stages,
        steps=steps,
        planner=planner,  # type: ignore[arg-type]
        overlap_forward=overlap_forward,
        gpu=FREE_FORK,
        split_weight_grads=False,  # the stage arms: the split has its own checks
    )


@pytest.mark.parametrize("overlap_forward", [False, True], ids=["joins", "overlap_forward"])
@pytest.mark.parametrize("planner", ["static", "dataflow"])
@pytest.mark.parametrize("branches", [2, 3], ids=["two_stages", "three_stages"])
def test_checkpointed_region_of_stages_passes_the_race_check(
    branches: int, planner: str, overlap_forward: bool
) -> None:
    # The recomputation runs inside the first node that unpacks (a stage's, on its side
    # stream); the nodes that read the recomputed tensors run on other streams, so each
    # must wait for the recomputation and record_stream what it reads.
    report = _check_branches(branches, planner, overlap_forward)
    assert report.ok, str(report)
    side = {row.stream for row in report.ops if row.stream != "default" and row.backward}
    # The branches did run apart (the dataflow plan may keep one on the caller's stream).
    assert len(side) >= branches - 1, str(report)


class _Dropping:
    """A backend that leaves one call out (a mutant of the recomputation's ordering)."""

    def __init__(self, backend: object, dropped: str) -> None:
        self._backend, self._dropped = backend, dropped

    def __getattr__(self, name: str) -> object:
        if name == self._dropped:
            return lambda *args: None
        return getattr(self._backend, name)


@pytest.mark.parametrize("dropped", ["wait_event", "record_stream"])
def test_without_ordering_the_recomputed_tensors_check_finds_it(
    monkeypatch: pytest.MonkeyPatch, dropped: str
) -> None:
    # Mutation test: each unpack's wait on the recomputation's end event is what orders
    # the readers, and its record_stream what keeps the memory from reuse.
    original = _recompute.order_unpacked

    def mutant(tensor: torch.Tensor, ends: list[tuple[Any, torch.device, Any]]) -> None:
        original(tensor, [(_Dropping(b, dropped), d, e) for b, d, e in ends])

    monkeypatch.setattr(_recompute, "order_unpacked", mutant)
    report = _check_branches(3, "static", steps=1)
    if dropped == "wait_event":
        assert report.races and not report.allocator_hazards, str(report)
    else:
        assert report.allocator_hazards and not report.races, str(report)


def test_a_recomputation_run_inline_is_ordered_for_its_readers() -> None:
    # Backward inside disabled(): the recomputed stage calls run inline on the stream of
    # the node that unpacked first, while the forward's nodes run on the stages' streams.
    torch.manual_seed(0)
    backend = DetectingBackend()
    model = ooo_wrap.OOOModule(
        CheckpointedBranches(3),
        streams=3,
        stages=["a", "b", "c"],
        backend=backend,
        planner="static",
    )
    with detect(backend, keep_alive=[model]) as found:
        out = model(torch.randn(8, 16))
        with ooo_wrap.disabled():
            out.square().mean().backward()
    assert model.stats.bypasses == 3  # the three recomputed calls
    assert found.ok, (found.races, found.allocator_hazards)


def test_learning_step_recomputing_on_a_new_side_stream_is_hazard_free() -> None:
    # The first dataflow step runs inline (every node on the caller's stream); the plan
    # is learned before its backward, whose recomputation then forks onto the new side
    # streams: what it saves is allocated there but read on the caller's stream.
    report = _check_branches(2, "dataflow", steps=1)
    assert report.not_checked is not None  # only the learning step ran
    assert not report.races and not report.allocator_hazards, str(report)


def test_recomputed_ops_are_labelled_with_their_stage() -> None:
    report = _check_branches(3, "static", steps=1)
    # addmm is a forward op (Linear's backward runs mm): in backward only recomputation
    # runs it, inside the node of stage c, which started it; each stage's own ops keep
    # its name and its stream.
    forward = {r.stage: r.stream for r in report.trace if r.op == "aten.addmm.default"}
    recomputed = {
        (r.stage, r.stream)
        for r in report.trace
        if r.phase == "backward" and r.op == "aten.addmm.default"
    }
    assert recomputed == {(name, forward[name]) for name in "abc"}, recomputed


class StemAndTowers(nn.Module):
    """A stem (not a stage) feeding a reentrant-checkpointed tower and a plain one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.left = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.right = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        left: torch.Tensor = checkpoint(self.left, h, use_reentrant=True)
        return left + self.right(h)


class CheckpointedRegion(StemAndTowers):
    """Both towers inside one reentrant checkpoint."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.region, self.stem(x), use_reentrant=True)
        return out

    def region(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.left(h) * self.right(h)
        return out


@pytest.mark.parametrize("model", [StemAndTowers, CheckpointedRegion], ids=["one", "two"])
@pytest.mark.parametrize("planner", ["static", "dataflow"])
def test_reentrant_checkpoint_returns_a_gradient_recorded_for_its_nodes_stream(
    planner: str, model: type[nn.Module]
) -> None:
    # CheckpointFunction.backward runs on the caller's stream, recomputes the stages on
    # their side streams and returns the detached input's .grad, made there by a stage's
    # backward; the caller's stream then reads it (stem's backward) and drops it.
    torch.manual_seed(0)
    for requires_grad in (False, True):
        x = torch.randn(4, 8, requires_grad=requires_grad)
        report = check(model(), x, stages=["left", "right"], planner=planner, steps=3)
        assert report.ok, str(report)


def test_without_recording_the_returned_gradient_the_check_finds_the_hazard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The mutation: the recomputed stage's input leaf gets no hook.
    monkeypatch.setattr(scheduler_module, "record_leaf_grads", lambda *args: None)
    torch.manual_seed(0)
    report = check(
        StemAndTowers(),
        torch.randn(4, 8),
        stages=["left", "right"],
        planner="static",
        steps=2,
        tune_arm="static",
    )
    assert [str(h.access) for h in report.allocator_hazards] == [
        "read by aten.add.Tensor on default (backward) of float32[4, 8]"
    ], str(report)
    assert report.allocator_hazards[0].allocated_on == "side1"
    assert not report.races


def test_a_stage_called_in_a_nodes_backward_leaves_a_persistent_leaf_one_hook() -> None:
    # Outside a reentrant checkpoint (a direct call, no backward running) no hook is added.
    backend = SimulatedBackend()
    model = ooo_wrap.OOOModule(StemAndTowers(), streams=2, backend=backend, planner="static")
    leaf = torch.randn(4, 8, requires_grad=True)
    model.left(leaf)
    assert not leaf._post_accumulate_grad_hooks  # type: ignore[attr-defined]
