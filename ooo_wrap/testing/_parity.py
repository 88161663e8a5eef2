"""Each output and gradient of a checked run against the plain run's, bit for bit."""

from __future__ import annotations

import math

import torch

from ._report import ParityEntry

__all__ = ["Named", "max_abs_diff", "parity"]

Named = dict[str, torch.Tensor]  # outputs or gradients by name, of one step


def parity(
    checked: list[tuple[Named, Named]], reference: list[tuple[Named, Named]]
) -> tuple[ParityEntry, ...]:
    """Per output and gradient, the largest difference over every step."""
    worst: dict[str, float] = {}
    for (out_a, grad_a), (out_b, grad_b) in zip(checked, reference, strict=True):
        for a_side, b_side in ((out_a, out_b), (grad_a, grad_b)):
            for name in dict.fromkeys([*a_side, *b_side]):
                diff = max_abs_diff(a_side.get(name), b_side.get(name))
                worst[name] = max(worst.get(name, 0.0), diff)
    return tuple(ParityEntry(name, diff) for name, diff in worst.items())


def max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """``0.0`` when bitwise equal (NaNs in the same places), ``inf`` if a side is missing
    or differs in shape, dtype or layout, else the largest absolute difference."""
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.layout != b.layout:
        return math.inf
    if a.layout != torch.strided:
        # Sparse gradients (nn.Embedding(sparse=True)): most comparisons below have no
        # sparse kernel, and two equal sparse tensors may hold their entries in another
        # order or uncoalesced, so compare the values they stand for.
        a, b = a.to_dense(), b.to_dense()
    if a.numel() == 0:
        return 0.0
    if torch.equal(a, b):  # the usual case, without the wide copies (NaN never equals)
        return 0.0
    if not (a.is_floating_point() or a.is_complex()):
        return math.inf
    wide = torch.complex128 if a.is_complex() else torch.float64
    a64, b64 = a.detach().to(wide), b.detach().to(wide)
    a_nan, b_nan = torch.isnan(a64), torch.isnan(b64)
    if not torch.equal(a_nan, b_nan):
        return math.inf
    same = (a64 == b64) | a_nan  # equal values, equal infinities, NaN in both
    if bool(same.all()):
        return 0.0
    return float((a64 - b64).abs().masked_fill(same, 0.0).max())
