"""The layers whose weight gradient can be split off: their stock math, split in two.

Each :class:`SplitRule` gives, for one layer type, the forward (the layer's own math on the
tensors it is handed), the input gradient (dI) and the weight and bias gradients (dW, db)
as separate functions. They copy the op order of autograd's own backward formulas
(``tools/autograd/derivatives.yaml``: ``addmm``, ``mm``, ``convolution``; the helpers
``mm_mat1_backward`` / ``mm_mat2_backward`` in ``FunctionsManual.cpp``), so on the CPU a
split layer's gradients are bitwise the stock layer's. ``tests/runtime/test_wgrad.py``
compares them against autograd on every layout the rules accept.

A rule may refuse a call (``accepts`` returns a reason): the layer then runs its stock
forward, unsplit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SplitRule",
    "register_split_layer",
    "rule_for",
]

Forward = Callable[[nn.Module, Tensor, Tensor, Tensor | None], Tensor]
InputGrad = Callable[[nn.Module, Tensor, Tensor, Tensor], Tensor]
WeightGrads = Callable[[nn.Module, Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor | None]]
Accepts = Callable[[nn.Module, Tensor], str | None]


def _accept_all(layer: nn.Module, x: Tensor) -> str | None:
    return None


@dataclass(frozen=True)
class SplitRule:
    """How one layer type computes its output and, apart, its input and weight gradients.

    Attributes:
        forward: ``forward(layer, x, weight, bias)``: the layer's output, exactly as its
            stock ``forward`` computes it, from these tensors (``bias`` may be ``None``).
        input_grad: ``input_grad(layer, grad_out, x, weight)``: the gradient of ``x``.
        weight_grads: ``weight_grads(layer, grad_out, x, weight, bias_needed)``: the
            gradient of the weight, and of the bias if ``bias_needed`` (else ``None``).
        accepts: ``accepts(layer, x)``: ``None`` if this call can be split, else a short
            reason to run the stock forward instead.
    """

    forward: Forward
    input_grad: InputGrad
    weight_grads: WeightGrads
    accepts: Accepts = _accept_all


# --- nn.Linear ------------------------------------------------------------------------
#
# aten::linear runs a 2-D input, and a contiguous N-d input flattened to 2-D, through
# addmm(bias, x, weight.t()) (mm without a bias); its backward is mm_mat1_backward and
# mm_mat2_backward with mat2 = weight.t(), and the bias gradient is the output gradient
# summed to the bias's shape (the engine's sum_to for the broadcast ``self`` of addmm).


def _linear_forward(layer: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


def _linear_accepts(layer: nn.Module, x: Tensor) -> str | None:
    if x.dim() < 2:
        return "input_rank"  # a 1-D input takes matmul's vector path
    if x.dim() > 2 and not x.is_contiguous():
        return "input_layout"  # matmul may fold it otherwise (transposes, copies)
    return None


def _flat(t: Tensor) -> Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _column_major(t: Tensor) -> bool:
    # The test of mm_mat1_backward / mm_mat2_backward: strides (1, rows).
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _linear_input_grad(layer: nn.Module, grad: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    g, mat1, mat2 = _flat(grad), _flat(x), weight.t()
    dx = mat2.mm(g.t()).t() if _column_major(mat1) else g.mm(mat2.t())
    return dx if x.dim() == 2 else dx.reshape(x.shape)


def _linear_weight_grads(
    layer: nn.Module, grad: Tensor, x: Tensor, weight: Tensor, bias_needed: bool
) -> tuple[Tensor, Tensor | None]:
    g, mat1, mat2 = _flat(grad), _flat(x), weight.t()
    # The gradient of mat2 = weight.t(), then t()'s backward: another t().
    dmat2 = g.t().mm(mat1).t() if _column_major(mat2) else mat1.t().mm(g)
    db = g.sum_to_size(weight.shape[:1]) if bias_needed else None
    return dmat2.t(), db


# --- nn.Conv1d / Conv2d / Conv3d --------------------------------------------------------
#
# aten::convolution's backward is convolution_backward with an output mask: dI with
# (True, False, False), dW and db with (False, True, bias).


def _conv_accepts(layer: nn.Module, x: Tensor) -> str | None:
    weight = getattr(layer, "weight", None)
    if getattr(layer, "padding_mode", "zeros") != "zeros":
        return "padding_mode"
    if isinstance(getattr(layer, "padding", None), str):
        return "padding_string"
    if weight is None or x.dim() != weight.dim():
        return "input_rank"  # an unbatched input is batched by the op itself
    return None


def _conv_forward(layer: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    conv: Any = layer
    op = _CONV[weight.dim()]
    return op(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def _conv_backward(
    layer: nn.Module, grad: Tensor, x: Tensor, weight: Tensor, mask: list[bool]
) -> tuple[Tensor, Tensor, Tensor]:
    n = weight.dim() - 2
    conv: Any = layer  # a ConvNd, or a subclass keeping its forward
    result: tuple[Tensor, Tensor, Tensor] = torch.ops.aten.convolution_backward(
        grad,
        x,
        weight,
        [weight.shape[0]] if mask[2] else None,
        list(conv.stride),
        list(conv.padding),
        list(conv.dilation),
        False,
        [0] * n,
        conv.groups,
        mask,
    )
    return result


def _conv_input_grad(layer: nn.Module, grad: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    return _conv_backward(layer, grad, x, weight, [True, False, False])[0]


def _conv_weight_grads(
    layer: nn.Module, grad: Tensor, x: Tensor, weight: Tensor, bias_needed: bool
) -> tuple[Tensor, Tensor | None]:
    _, dw, db = _conv_backward(layer, grad, x, weight, [False, True, bias_needed])
    return dw, (db if bias_needed else None)


_CONV: dict[int, Callable[..., Tensor]] = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}

LINEAR = SplitRule(_linear_forward, _linear_input_grad, _linear_weight_grads, _linear_accepts)
CONV = SplitRule(_conv_forward, _conv_input_grad, _conv_weight_grads, _conv_accepts)

# Stock layers, and the ``forward`` each must still have to be split (a subclass that
# overrides ``forward`` computes something else, and runs unsplit).
_STOCK: dict[type[nn.Module], SplitRule] = {
    nn.Linear: LINEAR,
    nn.Conv1d: CONV,
    nn.Conv2d: CONV,
    nn.Conv3d: CONV,
}
_REGISTERED: dict[type[nn.Module], SplitRule] = {}


def register_split_layer(
    layer_type: type[nn.Module],
    *,
    forward: Forward,
    input_grad: InputGrad,
    weight_grads: WeightGrads,
    accepts: Accepts | None = None,
) -> None:
    """Let ``split_weight_grads`` split layers of ``layer_type`` (and its subclasses).

    The layer must have a ``weight`` parameter and a ``bias`` parameter or ``None``, and
    its ``forward(x)`` must take one tensor. The functions get the layer and the tensors
    (under autocast, already cast as autocast casts them, the parameters through its
    weight cache; a weight of more than two dimensions is cast by running ``forward`` on
    an empty batch, and a call whose ``forward`` then saves no such cast runs the stock
    layer); each must compute exactly what
    autograd's backward of the stock ``forward`` computes, in the same op order, or the
    gradients differ in the last bits.

    Args:
        layer_type: the module class.
        forward: ``forward(layer, x, weight, bias) -> y``, the stock math.
        input_grad: ``input_grad(layer, grad_y, x, weight) -> grad_x``.
        weight_grads: ``weight_grads(layer, grad_y, x, weight, bias_needed) ->
            (grad_weight, grad_bias or None)``.
        accepts: ``accepts(layer, x) -> None`` if a call can be split, else a short
            reason; by default every call is split.

    Raises:
        TypeError: ``layer_type`` is not a module class, or a function is not callable.
    """
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise TypeError(f"layer_type must be an nn.Module subclass, got {layer_type!r}")
    for name, value in (
        ("forward", forward),
        ("input_grad", input_grad),
        ("weight_grads", weight_grads),
    ):
        if not callable(value):
            raise TypeError(f"{name} must be callable, got {value!r}")
    _REGISTERED[layer_type] = SplitRule(
        forward, input_grad, weight_grads, accepts if accepts is not None else _accept_all
    )


def rule_for(cls: type[nn.Module]) -> SplitRule | None:
    """The rule that splits calls of layers of class ``cls``, or ``None`` (unsplit)."""
    for base in cls.__mro__:
        rule = _REGISTERED.get(base)
        if rule is not None:
            return rule
        rule = _STOCK.get(base)
        if rule is not None:
            # A subclass of a stock layer is split only while it keeps the stock forward.
            stock_forward = getattr(base, "forward", None)
            return rule if getattr(cls, "forward", None) is stock_forward else None
    return None
