"""torch.func transforms over a wrapped model: ``record_stream`` has no batching rule.

On the CPU the real ``Tensor.record_stream`` cannot finish (the CPU backend has no kernel
for it), but a functorch-wrapped tensor fails earlier, in the transform's layer: the test
backend calls the real method and accepts only the CPU backend's own refusal, so a
functorch tensor reaching it fails the test as it would crash on a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ooo_wrap
from ooo_wrap.testing import SimulatedBackend, VirtualStream
from tests.support.models import make_two_towers, two_tower_input

_CPU_STREAM = torch.Stream(device="cpu")


class RealRecordStream(SimulatedBackend):
    """Virtual streams, but ``record_stream`` goes through the real ``Tensor`` method."""

    def __init__(self) -> None:
        super().__init__()
        self.reached_the_device = 0

    def record_stream(self, tensor: torch.Tensor, stream: VirtualStream) -> None:
        super().record_stream(tensor, stream)
        try:
            tensor.record_stream(_CPU_STREAM)
        except NotImplementedError as error:  # the CPU kernel's refusal: dispatch got there
            assert "CPU" in str(error)
            self.reached_the_device += 1


def test_plain_calls_reach_the_device_kernel() -> None:
    backend = RealRecordStream()
    model = ooo_wrap.OOOModule(make_two_towers(), backend=backend, planner="static")
    model(two_tower_input()).sum().backward()
    assert backend.reached_the_device == model.stats.record_streams == 4


@pytest.mark.parametrize("transform", ["vmap", "jacrev", "grad", "vmap_grad"])
def test_torch_func_transforms_over_a_wrapped_model(transform: str) -> None:
    backend = RealRecordStream()
    plain = make_two_towers()
    model = ooo_wrap.OOOModule(copy.deepcopy(plain), backend=backend, planner="static")
    x = two_tower_input()

    def run(m: torch.nn.Module) -> torch.Tensor:
        def f(v: torch.Tensor) -> torch.Tensor:
            return m(v).sum()

        if transform == "vmap":
            out: torch.Tensor = torch.func.vmap(m)(x)
        elif transform == "jacrev":
            out = torch.func.jacrev(f)(x)
        elif transform == "grad":
            out = torch.func.grad(f)(x)
        else:
            out = torch.func.vmap(torch.func.grad(f))(x)
        return out

    torch.testing.assert_close(run(model), run(plain), rtol=0, atol=0)
    assert model.stats.stage_calls == 2
    assert backend.reached_the_device == model.stats.record_streams > 0
    assert backend.current_stream() == VirtualStream(0)
