"""Out-of-order weight gradients: each split layer's dW runs on a weight-gradient stream.

A layer's backward is two products: the input gradient (dI), which the next layer's
backward needs at once, and the weight gradient (dW), which only the optimizer needs. A
split layer (``wgrad_layers.py`` says which, and how) computes dI on the stream its
backward runs on and dW on one weight-gradient stream per device, so the next layer's dI
overlaps this layer's dW. The autograd engine runs a node's backward on the stream that
was current when the node was made, and marks its gradients ready on that stream: a
tensor written on a third stream inside a backward is invisible to it. So the split lives
inside the engine's rules, per split layer call (``A`` the current stream, ``W`` the
weight-gradient stream):

1. Forward: the weight (and bias) enter through a pass-through node (:class:`_Handoff`)
   made while ``W`` is current, so its backward runs on ``W``; as it is normally the
   parameter's first use in the graph, the parameter's ``AccumulateGrad`` is made on
   ``W`` too. The pass-through is a view: no kernel. Under autocast what enters it is
   autocast's own cast of each parameter, taken through its weight cache (which, for the
   rest of its region, serves a cast made before an in-place update such as an optimizer
   step inside the region, as stock layers read it); a cast made now is made on ``W``, so
   its backward (dW back to the parameter's dtype) runs on ``W``. Those casts are kernels
   on ``W`` in forward, so ``W`` first waits on an event recorded on ``A`` (the
   parameters' last writes), and ``A`` then waits on one recorded on ``W`` and
   ``record_stream``-s the casts, which it reads in the layer's forward and dI.
2. Forward: the layer's :class:`_Split` node is made on ``A`` and computes the stock math.
3. Backward of ``_Split`` (on ``A``, the output gradient ``g`` ready there): ``g`` and the
   saved tensors get ``record_stream(W)``, since ``W`` reads them while ``A`` may free
   them; then an event ``e`` is recorded on ``A`` (after the ``record_stream`` calls,
   which older CUDA Stream Sanitizers count as work on the current stream) and ``W``
   waits on it.
4. dI is computed on ``A``, then dW (and db) on ``W``, in the parameter's exact dtype,
   shape and strides (the engine would otherwise convert them on ``A``, reading them
   unordered); ``A`` is current again before the backward returns.
5. The engine hands dW to the pass-through node on ``W`` (it waits there on ``A``'s ready
   event, which adds nothing), which hands it on from ``W``: every consumer is then
   ordered after dW by the engine's own rules, the accumulator wherever it lives
   (``DistributedDataParallel`` holds ones made on the caller's stream; a tied weight's
   first use may be elsewhere), hooks, and the end-of-backward wait of the caller's
   stream on leaf streams. dW's memory was allocated on ``W``; the engine
   ``record_stream``s it to any other consumer stream.
6. Memory: each dW holds its layer's output gradient and input (and, under autocast, the
   cast weight) until it ran, so ``W`` may lag ``A`` only by a byte budget: once a dW is
   launched, ``A`` waits on the oldest pending dW until the bytes the pending ones hold
   fit within ``HELD_FRACTION`` of the device's live bytes when the backward's first
   split layer launched its dW. Those live bytes are alive at the same point of a plain
   backward, so at any point of the split backward the extra bytes are at most
   ``HELD_FRACTION`` of a plain backward's peak. Where the backend cannot tell live bytes
   (the simulated one), the budget is 0: ``A`` waits on each layer's dW right after
   launching it, so dW overlaps only its own layer's dI. The events are dropped when the
   backward ends (the engine's end-of-backward wait on leaf streams covers the rest).

With ``create_graph=True`` (known only in backward: grad mode is on there) the backward
computes dI and dW inline on ``A`` with differentiable ops, so a gradient penalty's double
backward is the stock one. Calls run the stock layer, unsplit, with gradients off, in
anomaly mode, under functorch transforms or ``torch.compile`` tracing, outside a planned
forward of the wrapped model (the plain arm of measured tuning, ``ooo_wrap.disabled()``,
a checkpoint recomputing in backward), for a parameter that is not a plain dense tensor
(FSDP2's sharded ``DTensor``), where the rule refuses the call, and under autocast where
autocast's cast of a parameter cannot be reached (1.).

The layers' classes are swapped (:func:`swapped_class`, cached per class) only while the
split is installed; :meth:`WeightGradSplit.remove` restores each exactly. A swapped layer
pickles and copies as its original class.
"""

from __future__ import annotations

import collections
import functools
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .._compat import functorch_transforms_active, is_fsdp_managed, queue_engine_callback
from .._events import EventKind, EventLog, OOOEvent
from .._stats import Counters
from .backend import Backend, Event, Stream, live_bytes_of
from .bypass import eager_bypass_reason
from .inflight import thread_state
from .wgrad_function import LayerCall, run_split
from .wgrad_layers import SplitRule, rule_for

__all__ = ["WeightGradSplit", "split_layers", "swapped_class"]

logger = logging.getLogger("ooo_wrap")

# layer -> the split it belongs to, while installed (weakly: never keeps a layer alive).
_owners: weakref.WeakKeyDictionary[nn.Module, WeightGradSplit] = weakref.WeakKeyDictionary()
# original class -> its swapped class; classes live for the process.
_classes: dict[type[nn.Module], type[nn.Module]] = {}

# The most bytes the pending weight gradients may hold, as a fraction of the device's live
# bytes when the backward's first split layer ran (6.).
HELD_FRACTION = 0.10

_MESSAGES = {
    "no_grad": "gradients are off: no weight gradient to split",
    "anomaly": "anomaly mode is on: stock layers, so its traces name the stock ops",
    "functorch": "a functorch transform is running: stock layers",
    "outside_forward": "the layer ran outside a planned forward of the wrapped model (the "
    "plain arm of tuning, ooo_wrap.disabled(), a checkpoint recomputing): stock layer",
    "not_dense": "a parameter is not a plain dense tensor (e.g. sharded by fully_shard): "
    "stock layer, since its owner reads or reduces .grad on its own streams",
    "frozen": "the weight does not require grad: nothing to split",
    "fsdp": "the layer is managed by fully_shard (FSDP2), whose post-backward reads .grad "
    "in the middle of backward and orders its reduce-scatter after the caller's stream only: "
    "stock layer",
    "autocast_weight": "under autocast, autocast's cast of a parameter could not be reached "
    "(a parameter of more than two dimensions that the layer's own op does not save): "
    "stock layer",
    "create_graph": "backward with create_graph=True: weight gradients computed inline, "
    "differentiably",
}


def split_layers(model: nn.Module, exclude: Iterable[str] = ()) -> list[tuple[str, nn.Module]]:
    """The sub-modules of ``model`` a split would swap (named, each once), less the names
    in ``exclude`` and anything below them."""
    skipped = tuple(exclude)
    found = []
    for name, module in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skipped):
            continue
        if module is not model and rule_for(type(module)) is not None:
            found.append((name, module))
    return found


class WeightGradSplit:
    """The weight-gradient split of one wrapped model: its layers, its streams.

    ``owner`` is the scheduler of the model: a layer call is split only inside a root call
    of that scheduler that runs planned (``RootCall.bypass is None``).
    """

    def __init__(
        self, owner: object, backend: Backend, counters: Counters, events: EventLog
    ) -> None:
        self.owner = owner
        self.backend = backend
        self.counters = counters
        self.events = events
        self._streams: dict[torch.device, Stream] = {}  # one weight-gradient stream per device
        self._layers: list[tuple[weakref.ref[nn.Module], type[nn.Module]]] = []
        self._reported: set[str] = set()
        self._forward_planned = False  # whether the model's last forward ran planned
        # Per device, this backward's pending dW (6.); dropped when the backward ends.
        self._lag: dict[torch.device, _Lag] = {}

    def install(self, layers: Iterable[nn.Module]) -> None:
        """Swap each layer's class (its original kept to restore)."""
        for layer in layers:
            if layer in _owners:
                continue  # listed twice (a shared layer)
            original = type(layer)
            layer.__class__ = swapped_class(original)
            _owners[layer] = self
            self._layers.append((weakref.ref(layer), original))

    def remove(self) -> None:
        """Restore every layer's class exactly (idempotent)."""
        for ref, original in self._layers:
            layer = ref()
            if layer is not None and _owners.get(layer) is self:
                layer.__class__ = original
                del _owners[layer]
        self._layers.clear()

    @property
    def layers(self) -> int:
        """How many layers are swapped now."""
        return len(self._layers)

    def stream(self, device: torch.device) -> Stream:
        """The weight-gradient stream of ``device`` (made on first use)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self.backend.new_stream(device)
        return stream

    def dw_launched(self, device: torch.device, stream: Stream, held: int) -> list[Event]:
        """6. Note the dW just launched on ``stream`` (current), holding ``held`` bytes;
        return the events of the oldest pending dW that the layer's stream must now wait
        on so that the pending ones hold at most the budget."""
        lag = self._lag.get(device)
        if lag is None:
            budget = int(HELD_FRACTION * live_bytes_of(self.backend, device))
            lag = self._lag[device] = _Lag(budget)
            # Events never outlive the backward (a wait must not cross a graph capture's
            # boundary): the engine's end-of-backward callback drops them.
            queue_engine_callback(functools.partial(self._end_backward, device))
        lag.pending.append((self.backend.record_event(stream), held))
        lag.held += held
        waits = []
        while lag.held > lag.budget:
            event, size = lag.pending.popleft()
            lag.held -= size
            waits.append(event)
        return waits

    def _end_backward(self, device: torch.device) -> None:
        self._lag.pop(device, None)

    def step_aside(self, reason: str) -> None:
        """Count a layer call that ran stock, and say why once."""
        self.counters.split_step_asides += 1
        if reason not in self._reported:
            self._reported.add(reason)
            self.events.add(
                OOOEvent(EventKind.BYPASSED, f"weight_grads_{reason}", _MESSAGES[reason]),
                level=logging.INFO,
            )

    def _reason(self, layer: nn.Module, rule: SplitRule, x: Tensor) -> str | None:
        local = thread_state
        calls = local.calls
        if calls and calls[-1].owner is self.owner:
            planned = self._forward_planned = calls[-1].bypass is None
        else:
            # A checkpoint recomputing in backward must save what its forward saved: it
            # splits if the model's last forward did (the forwards a backward runs through
            # are of one arm of measured tuning, whose decision may come after them).
            planned = (
                not calls
                and local.recomputing is not None
                and self._forward_planned
                and eager_bypass_reason() is None
            )
        if not planned:
            return "no_grad" if not torch.is_grad_enabled() else "outside_forward"
        if not torch.is_grad_enabled():
            return "no_grad"
        if torch.is_anomaly_enabled():
            return "anomaly"
        if functorch_transforms_active():
            return "functorch"
        if is_fsdp_managed(layer):
            return "fsdp"  # its post-backward reads .grad mid-backward, on its own streams
        weight, bias = _params(layer)
        if weight is None or not weight.requires_grad:
            return "frozen"
        for param in (weight, bias):
            if param is not None and (
                type(param.data) is not torch.Tensor or param.layout != torch.strided
            ):
                return "not_dense"
        return rule.accepts(layer, x)

    def forward(self, layer: nn.Module, original: type[nn.Module], x: Any) -> Any:
        """A swapped layer's forward: split, or the stock one (counted)."""
        rule = rule_for(original)
        assert rule is not None  # split_layers swapped only layers with a rule
        reason = "input_type" if not isinstance(x, Tensor) else self._reason(layer, rule, x)
        if reason is not None:
            if reason not in _MESSAGES:
                _MESSAGES[reason] = f"the layer refused this call ({reason}): stock layer"
            self.step_aside(reason)
            return original.forward(layer, x)
        weight, bias = _params(layer)
        assert weight is not None  # _reason refused a layer without one
        # Counted first: a checkpoint's recomputation may stop inside the call, once the
        # split node has saved what the backward needs.
        self.counters.split_layer_calls += 1
        call = LayerCall(self, rule, layer, self.stream(weight.device))
        out = run_split(call, x, weight, bias)
        if out is None:
            self.counters.split_layer_calls -= 1
            self.step_aside("autocast_weight")
            return original.forward(layer, x)
        return out


class _Lag:
    """One device's pending dW in the running backward (6.)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget  # bytes the pending dW may hold
        self.held = 0  # bytes they hold now
        self.pending: collections.deque[tuple[Event, int]] = collections.deque()  # oldest first


def _params(layer: nn.Module) -> tuple[Tensor | None, Tensor | None]:
    """The layer's weight and bias, each ``None`` where it is no tensor."""
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    return (
        weight if isinstance(weight, Tensor) else None,
        bias if isinstance(bias, Tensor) else None,
    )


def swapped_class(original: type[nn.Module]) -> type[nn.Module]:
    """The cached subclass of ``original`` whose ``forward`` splits, named as ``original``
    (qualified name ``OOOSplit<Qualname>``); it pickles and copies as ``original``."""
    cls = _classes.get(original)
    if cls is None:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling() or kwargs or len(args) != 1:
                # Compiling: before any look-up, so no graph break. Other calling
                # conventions (``input=x``) run the stock layer.
                return original.forward(self, *args, **kwargs)
            split = _owners.get(self)
            if split is None:  # a copy made some other way: the stock layer
                return original.forward(self, *args)
            return split.forward(self, original, args[0])

        def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
            # Copies and pickles are of the plain layer (the split is the wrapper's).
            return (_plain_instance, (original,), self.__getstate__())  # type: ignore[no-untyped-call]

        namespace: dict[str, Any] = {
            "forward": forward,
            "__reduce_ex__": __reduce_ex__,
            "_ooo_split_original": original,
            "__module__": original.__module__,
            "__qualname__": f"OOOSplit{original.__qualname__}",
        }
        cls = _classes[original] = type(original.__name__, (original,), namespace)
    return cls


def _plain_instance(cls: type[nn.Module]) -> nn.Module:
    """An empty instance of a layer's original class (a copy's or pickle's first step)."""
    return cls.__new__(cls)
