"""The detector under functorch transforms: a stage called inside ``vmap`` or
``torch.func.grad`` gets wrapper tensors (batched, grad-tracking) that have no storage of
their own; the checker follows them to the tensor they wrap."""

from __future__ import annotations

import torch
from torch import nn

import ooo_wrap
from ooo_wrap.testing import DetectingBackend, check, detect, host_read


class PerSample(nn.Module):
    """A stem, then a stage the parent maps over the batch with ``vmap``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.head = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.vmap(self.head)(self.stem(x))
        return out


def test_a_stage_called_under_vmap_passes_the_check() -> None:
    report = check(PerSample(), torch.randn(3, 4), streams=2, planner="static", tune_arm="static")
    assert report.ok, str(report)
    rows = {row.stream: row for row in report.ops}
    assert rows["side2"].forward > 0 and rows["side2"].backward > 0


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_a_wrapped_model_under_func_grad_and_vmap() -> None:
    torch.manual_seed(0)
    plain = Two()
    backend = DetectingBackend()
    wrapped = ooo_wrap.OOOModule(Two(), streams=2, backend=backend, planner="static")
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(3, 4)
    params = dict(wrapped.named_parameters())
    with detect(backend, keep_alive=[wrapped]) as found:
        batched = torch.vmap(wrapped)(x)
        grads = torch.func.grad(lambda p: torch.func.functional_call(wrapped, p, (x,)).sum())(
            params
        )
        grad_x = torch.func.grad(lambda x: wrapped(x).sum())(x)
        host_read(batched)
        for tensor in (*grads.values(), grad_x):
            found.keep_alive(tensor)  # made on the stages' streams: kept, as .grad is
            host_read(tensor)
    assert found.ok, (found.races, found.allocator_hazards)
    torch.testing.assert_close(batched, plain(x))
    torch.testing.assert_close(grad_x, torch.func.grad(lambda x: plain(x).sum())(x))
    assert {"side1", "side2"} <= {op.stream for op in found.ops}


class DeepTwo(nn.Module):
    """Two stages whose backward reads activations they made on their own streams."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.b = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


def test_the_backward_of_func_grad_runs_on_the_streams_of_the_forward() -> None:
    # torch.func.grad runs the autograd engine on nodes made above the detector's view:
    # each node's backward still runs on the stream that made it, as in a plain backward.
    backend = DetectingBackend()
    wrapped = ooo_wrap.OOOModule(DeepTwo(), streams=2, backend=backend, planner="static")
    params = dict(wrapped.named_parameters())
    x = torch.randn(3, 4)
    with detect(backend, keep_alive=[wrapped]) as found:
        grads = torch.func.grad(lambda p: torch.func.functional_call(wrapped, p, (x,)).sum())(
            params
        )
        for grad in grads.values():
            found.keep_alive(grad)
            host_read(grad)
    assert found.ok, (found.races, found.allocator_hazards)
    forward = {op.stream for op in found.ops if op.op == "aten.tanh.default"}
    backward = {op.stream for op in found.ops if op.op == "aten.tanh_backward.default"}
    assert len(forward) == 2 and backward == forward
    assert {op.phase for op in found.ops if op.op == "aten.tanh_backward.default"} == {"backward"}
