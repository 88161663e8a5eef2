"""The cost model: roofline estimates per aten op on a reference GPU."""

from __future__ import annotations

import math

import pytest
import torch

from ooo_wrap._planner.cost import (
    ELEMENTS_PER_BLOCK,
    H200,
    ReferenceGPU,
    estimate_op,
    launches_kernel,
)

aten = torch.ops.aten


def test_matmul_matches_the_hand_computed_roofline() -> None:
    a, b = torch.randn(2048, 1024), torch.randn(1024, 4096)
    out = a @ b
    cost = estimate_op(aten.mm.default, (a, b), {}, out)
    flops = 2 * 2048 * 1024 * 4096
    nbytes = 4 * (2048 * 1024 + 1024 * 4096 + 2048 * 4096)
    assert cost.flops == flops
    assert cost.bytes == nbytes
    assert cost.occupancy == 1.0  # 8M output elements fill 132 SMs many times over
    expected = max(flops / 67e12, nbytes / 4.8e12) * 1e6 + H200.kernel_floor_us
    assert cost.device_us == pytest.approx(expected)
    assert cost.launches
    # Compute-bound in float32 on an H200: the FLOP term wins.
    assert flops / 67e12 > nbytes / 4.8e12


def test_a_view_costs_nothing_and_launches_nothing() -> None:
    x = torch.randn(64, 64)
    for func, args, out in [
        (aten.t.default, (x,), x.t()),
        (aten.view.default, (x, [4096]), x.view(4096)),
        (aten.empty.memory_format, ([64],), torch.empty(64)),
    ]:
        cost = estimate_op(func, args, {}, out)
        assert not launches_kernel(func)
        assert (cost.device_us, cost.flops, cost.bytes, cost.launches) == (0.0, 0, 0, False)


def test_dtype_changes_the_peak() -> None:
    a32, b32 = torch.randn(4096, 4096), torch.randn(4096, 4096)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    # The estimate reads the result's shape and dtype only: an empty one of each, since a
    # 4096-square bfloat16 product takes minutes on a CPU without bfloat16 matrix units.
    fp32 = estimate_op(aten.mm.default, (a32, b32), {}, torch.empty(4096, 4096))
    bf16 = estimate_op(aten.mm.default, (a16, b16), {}, torch.empty_like(a16))
    assert fp32.flops == bf16.flops
    floor = H200.kernel_floor_us
    assert (fp32.device_us - floor) / (bf16.device_us - floor) == pytest.approx(989 / 67)


def test_small_kernels_get_the_occupancy_penalty_and_the_floor() -> None:
    x = torch.randn(ELEMENTS_PER_BLOCK)  # one block: 1 of 132 SMs
    cost = estimate_op(aten.relu.default, (x,), {}, x.relu())
    assert cost.flops == 0
    assert cost.occupancy == pytest.approx(1 / 132)
    expected = 2 * x.nbytes / (4.8e12 / 132) * 1e6 + H200.kernel_floor_us
    assert cost.device_us == pytest.approx(expected)
    tiny = torch.randn(3)
    assert estimate_op(aten.relu.default, (tiny,), {}, tiny.relu()).device_us >= 2.0


def test_elementwise_is_memory_bound() -> None:
    x = torch.randn(1 << 22)
    cost = estimate_op(aten.add.Tensor, (x, x), {}, x + x)
    assert cost.bytes == 3 * x.nbytes
    assert cost.device_us == pytest.approx(3 * x.nbytes / 4.8e12 * 1e6 + 2.0)


def test_convolution_uses_the_registered_formula() -> None:
    x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    out = torch.nn.functional.conv2d(x, w, padding=1)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    cost = estimate_op(aten.convolution.default, args, {}, out)
    assert cost.flops == 2 * math.prod(out.shape) * 3 * 3 * 3


def test_a_reference_gpu_checks_itself() -> None:
    with pytest.raises(ValueError, match="peak_flops"):
        ReferenceGPU("x", (), 1.0, 1, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="sm_count"):
        ReferenceGPU("x", ((torch.float32, 1.0),), 1.0, 0, 1.0, 1.0, 1.0)
    assert H200.peak(torch.int64) == 67e12  # not listed: the float32 figure
    assert "H200" in H200.name and "estimate" in H200.name


def test_cpu_attention_is_counted_as_the_gpu_kernel_it_stands_for() -> None:
    from torch.utils.flop_counter import sdpa_flop_count

    seen: list[tuple[str, int]] = []

    class Costs(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            seen.append(
                (func.overloadpacket.__name__, estimate_op(func, args, kwargs or {}, out).flops)
            )
            return out

    q = torch.randn(2, 2, 8, 16, requires_grad=True)
    with Costs():
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    forward = sdpa_flop_count(q.shape, q.shape, q.shape)
    assert ("_scaled_dot_product_flash_attention_for_cpu", forward) in seen
    backward = [f for name, f in seen if name.endswith("_for_cpu_backward")]
    assert backward and backward[0] > forward


def test_flops_match_the_flop_counter_on_a_convolutional_training_step() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    total = 0

    class Costs(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            nonlocal total
            out = func(*args, **(kwargs or {}))
            total += estimate_op(func, args, kwargs or {}, out).flops
            return out

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(5)
    )
    x = torch.randn(2, 3, 8, 8)
    model(x)  # materialise the lazy layer outside both counters
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    with Costs():
        model(x).sum().backward()
    assert total == counter.get_total_flops() > 0
