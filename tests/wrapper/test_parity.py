"""Wrapped vs plain: outputs and gradients bitwise equal over three optimizer steps."""

from __future__ import annotations

import copy

import pytest
import torch

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap._tensors import tensors_in
from ooo_wrap.testing import SimulatedBackend
from tests.support.models import SHAPES, Shape, loss_of

STEPS = 3


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_wrapped_matches_plain_bitwise(shape: Shape, streams: int) -> None:
    wrapped = shape.make_model()
    plain = copy.deepcopy(wrapped)  # before wrapping: an identical, never-hooked twin
    args, kwargs = shape.make_inputs()
    backend = SimulatedBackend()

    assert ooo_wrap.OOOModule(wrapped, streams, backend=backend, planner="static") is wrapped
    assert isinstance(wrapped, ooo_wrap.OOOModule)
    assert not isinstance(plain, ooo_wrap.OOOModule)

    opt_wrapped = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        opt_wrapped.zero_grad()
        opt_plain.zero_grad()
        out_wrapped = wrapped(*args, **kwargs)
        out_plain = plain(*args, **kwargs)
        assert type(out_wrapped) is type(out_plain)
        got, want = tensors_in(out_wrapped), tensors_in(out_plain)
        assert len(got) == len(want) > 0
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"step {step}: output {index} differs"

        loss_of(out_wrapped).backward()
        loss_of(out_plain).backward()
        named_wrapped = list(wrapped.named_parameters())
        named_plain = list(plain.named_parameters())
        assert [n for n, _ in named_wrapped] == [n for n, _ in named_plain]
        for (name, p_wrapped), (_, p_plain) in zip(named_wrapped, named_plain, strict=True):
            assert p_wrapped.grad is not None, f"step {step}: {name} got no gradient"
            assert p_plain.grad is not None
            assert torch.equal(p_wrapped.grad, p_plain.grad), f"step {step}: grad of {name}"
        opt_wrapped.step()
        opt_plain.step()

    for (name, p_wrapped), (_, p_plain) in zip(
        wrapped.named_parameters(), plain.named_parameters(), strict=True
    ):
        assert torch.equal(p_wrapped, p_plain), f"parameter {name} after {STEPS} steps"

    # It really ran on side streams: every stage call forked and joined.
    kinds = [event.kind for event in wrapped.events]
    assert kinds == [EventKind.ENABLED]
    stats = wrapped.stats
    assert stats.forwards == STEPS
    assert stats.stage_calls == STEPS * shape.stage_calls_per_forward
    assert stats.bypasses == 0
    assert stats.failures == 0
    side_streams = {call.stream for call in backend.log if call.op == "new_stream"}
    assert len(side_streams) == min(streams, len(wrapped.plan.stages))
    switched_to = {call.stream for call in backend.log if call.op == "set_stream"}
    assert side_streams <= switched_to
