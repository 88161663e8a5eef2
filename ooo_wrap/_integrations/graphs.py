"""CUDA graph recipe: a whole training step captured once (:func:`graphed_step`); PyTorch's
partial-network capture of wrapped models is ``graphed_callables.py``.

Under capture a wrapped model's stages fork onto their side streams and join back as in
eager mode, so the graph records the same multi-stream schedule and every replay runs it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from .._compat import stale_capture_streams_overridden
from .._errors import OOOConfigError, OOOError, positive_int
from .._events import EventKind, OOOEvent
from .._tensors import non_tensor_leaves
from .._wrapper.registry import hold_for_graph, is_wrapped, let_go_of_graph, race_as_graph
from .._wrapper.tuning import Shape, shape_of
from .graph_race import Capture, Grads, GraphRace, bind_grads

__all__ = ["GraphedStep", "graphed_step"]

logger = logging.getLogger("ooo_wrap")

Reason = Literal["captured", "no_cuda", "not_on_cuda"]

# The dataflow planner runs the first training forward inline to learn the plan; only the
# second runs the stages on their side streams, as the capture will.
_MIN_WARMUP = 2


@dataclass(frozen=True)
class _ArgSpec:
    """What a replay's argument must match: a graph reads fixed addresses and sizes."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _ArgSpec:
        return cls(tensor.shape, tensor.dtype, tensor.device)

    def __str__(self) -> str:
        return f"a {self.dtype} tensor of shape {tuple(self.shape)} on {self.device}"


class GraphedStep:
    """A training step captured in a CUDA graph, or run eagerly where it cannot be.

    Made by :func:`graphed_step`; call it with new tensors of the sample args' shapes.

    Attributes:
        captured: whether the step was captured (calls replay the graph).
        reason: ``"captured"``, or why not: ``"no_cuda"`` (no CUDA device) or
            ``"not_on_cuda"`` (the sample args are on another device).
        message: one sentence saying the same to a person.
        graph: the ``torch.cuda.CUDAGraph``, or ``None`` when not captured, or while a
            wrapped model's arms race as graphs (``racing``: one graph per arm).
        static_args: the input buffers the graph reads (``()`` when not captured).
        static_outputs: what ``step_fn`` returned during capture, rewritten by every
            replay (``None`` when not captured; while racing, the last replayed graph's).
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        specs: tuple[_ArgSpec, ...],
        reason: Reason,
        message: str,
        graph: torch.cuda.CUDAGraph | None = None,
        static_args: tuple[torch.Tensor, ...] = (),
        static_outputs: Any = None,
        *,
        race: GraphRace | None = None,
    ) -> None:
        self.captured = graph is not None or race is not None
        self.reason: Reason = reason
        self.message = message
        self.graph = graph
        self.static_args = static_args
        self.static_outputs = static_outputs
        self._step_fn = step_fn
        self._specs = specs
        self._race = race
        self._grads: Grads | None = None  # the winner's, bound after its next replay

    def __call__(self, *args: torch.Tensor) -> Any:
        """Run one step on ``args``: copy them into the static buffers and replay, returning
        the static outputs; or, when not captured, ``step_fn(*args)``.

        Raises:
            OOOConfigError: an argument is missing, extra, not a tensor, or differs from
                its sample arg in shape, dtype or device (checked on every device, so a
                script that runs without CUDA runs with it).
        """
        self._check(args)
        if not self.captured:
            return self._step_fn(*args)
        for static, arg in zip(self.static_args, args, strict=True):
            if arg is not static:
                static.copy_(arg)  # on the current stream, which the replay is queued on
        if self._race is not None and self._race.decided:
            self._keep_winner()  # decided by another graphed step of the model
        if self._race is None:
            assert self.graph is not None
            self.graph.replay()
            if self._grads is not None:  # the first replay of the winner after the race
                bind_grads(self._grads)
                self._grads = None
            return self.static_outputs
        # This call's outputs and .grad are those of the graph replayed now, even when
        # this replay decides for another arm.
        outputs, decided = self._race.replay()
        if decided:
            self._keep_winner()
        return outputs

    @property
    def racing(self) -> tuple[str, ...]:
        """The arms whose graphs the calls replay in turn while a wrapped model's arms race
        as graphs (plain first); ``()`` once decided, or when nothing races."""
        return () if self._race is None else self._race.arms

    def _keep_winner(self) -> None:
        """The race decided: every call replays the winner's graph from now on."""
        race, self._race = self._race, None
        assert race is not None
        graph, self.static_outputs, self._grads = race.winner()
        self.graph = graph  # type: ignore[assignment]  # a CUDAGraph, as captured

    def __repr__(self) -> str:
        return f"GraphedStep(captured={self.captured}, reason={self.reason!r})"

    def _check(self, args: tuple[Any, ...]) -> None:
        if len(args) != len(self._specs):
            raise OOOConfigError(
                f"the graphed step takes {len(self._specs)} tensor args (as many as its "
                f"sample args), got {len(args)}; pass the same args in the same order"
            )
        for index, (arg, spec) in enumerate(zip(args, self._specs, strict=True)):
            if not isinstance(arg, torch.Tensor):
                raise OOOConfigError(
                    f"arg {index} of the graphed step is a {type(arg).__name__}, not a "
                    f"tensor; pass {spec}, as the sample arg was"
                )
            if _ArgSpec.of(arg) != spec:
                raise OOOConfigError(
                    f"arg {index} of the graphed step is {_ArgSpec.of(arg)}, but the step "
                    f"was made for {spec}: a graph replays fixed shapes, dtypes and "
                    "devices. Pad the batch to that shape or drop a last partial batch, "
                    "convert it, or make one graphed_step per shape"
                )


def graphed_step(
    step_fn: Callable[..., Any], *sample_args: torch.Tensor, warmup: int = 3
) -> GraphedStep:
    """Capture a whole training step (forward, loss, backward, ``optimizer.step()``) in a
    CUDA graph; calls then copy their tensors in and replay it.

    What it does that a hand-written capture often gets wrong: the graph reads static
    clones of the sample args, so the caller's tensors are never captured; ``warmup``
    eager steps run first on a side stream that waits on the current stream (lazy
    initialisation, optimizer state, cuBLAS workspaces, the wrapped models' learned plans
    and their stage streams all happen outside the capture), and the current stream waits
    on it afterwards; the warm-up's outputs are dropped before capture, so no autograd
    graph keeps gradient accumulators bound to warm-up streams; where this torch has
    ``torch.autograd.graph.set_override_stale_capture_stream``, it is on for the capture
    only, and put back as it was. A wrapped model that tunes is raced as graphs: each of
    its arms gets one more eager step and a graph of its own, and the calls replay them
    in turn, timed, until the tuner decides (``racing`` names them); then every call
    replays the winner's graph (``graph_race.py``). Without CUDA (or for sample args not
    on CUDA) nothing is captured: the warm-up steps and every call run ``step_fn``
    eagerly, with the eager results (and eager tuning), and ``reason`` says why (also
    logged at INFO on the ``ooo_wrap`` logger).

    The warm-up steps are real training steps on the sample args, on every device, so a
    run without CUDA takes the same steps. ``step_fn`` should start with
    ``optimizer.zero_grad(set_to_none=True)`` (gradients are then allocated inside the
    capture and rewritten by each replay); Adam and AdamW need ``capturable=True``. The
    outputs of a replay are the same tensors each time: read or clone them before the
    next call.

    Args:
        step_fn: the step; called as ``step_fn(*args)``, returns a tensor or a nest of
            tensors (tuples, lists, dicts; ``None`` allowed), e.g. the loss.
        *sample_args: the step's input tensors, as every call will pass them (same
            shapes, dtypes, devices); at least one.
        warmup: eager steps before capture, at least 2.

    Returns:
        A :class:`GraphedStep`: ``graphed(*args)`` runs one step and returns its outputs;
        ``.captured``, ``.reason`` and ``.message`` say whether it replays a graph.

    Raises:
        OOOConfigError: ``step_fn`` is not callable, ``warmup`` is not an int of at least
            2, there are no sample args, one is not a tensor, they span several devices,
            or ``step_fn`` returned something other than tensors.
        OOOError: the capture failed (the original error is its ``__cause__``): most
            often a host sync inside the step (``.item()``, ``nonzero``, a data-dependent
            shape) or an optimizer without ``capturable=True``.

    Example::

        >>> def step(x, y):
        ...     optimizer.zero_grad(set_to_none=True)
        ...     loss = F.cross_entropy(model(x), y)
        ...     loss.backward()
        ...     optimizer.step()
        ...     return loss
        >>> graphed = ooo_wrap.graphed_step(step, x0, y0)
        >>> for x, y in batches:
        ...     loss = graphed(x, y)
    """
    if not callable(step_fn):
        raise OOOConfigError(
            f"graphed_step's step_fn must be callable, got {type(step_fn).__name__}; "
            "pass the step function first: graphed_step(step, x, y)"
        )
    warmup = _check_warmup(warmup)
    specs = _sample_specs(sample_args)
    device = specs[0].device
    if not torch.cuda.is_available():
        reason: Reason = "no_cuda"
        message = (
            "no CUDA device: not captured; the warm-up steps and every call run the step eagerly"
        )
    elif device.type != "cuda":
        reason = "not_on_cuda"
        message = (
            f"the sample args are on {device}, not a CUDA device: not captured; the warm-up "
            "steps and every call run the step eagerly (move the inputs and the model to "
            "CUDA to capture)"
        )
    else:
        return _capture(step_fn, sample_args, specs, warmup, device)
    logger.info("ooo_wrap.graphed_step: %s (%s)", message, reason)
    for step in range(warmup):
        outputs = step_fn(*sample_args)
        if step == 0:
            _check_outputs(outputs)
    return GraphedStep(step_fn, specs, reason, message)


def _check_warmup(warmup: object) -> int:
    count = positive_int(warmup, "graphed_step's warmup", " of at least 2")
    if count < _MIN_WARMUP:
        raise OOOConfigError(
            f"graphed_step's warmup must be at least {_MIN_WARMUP}, got {count}: a wrapped "
            "model (default dataflow planner) learns its plan on its first training "
            "forward, which runs inline, so only the second runs its stages on their side "
            "streams as the capture will, and sets up those streams' cuBLAS workspaces "
            f"outside the capture; pass warmup={_MIN_WARMUP} or more (the default is 3)"
        )
    return count


def _sample_specs(sample_args: tuple[Any, ...]) -> tuple[_ArgSpec, ...]:
    if not sample_args:
        raise OOOConfigError(
            "graphed_step needs the step's input tensors as sample args, e.g. "
            "graphed_step(step, x, y): the graph reads copies of them"
        )
    for index, arg in enumerate(sample_args):
        if not isinstance(arg, torch.Tensor):
            raise OOOConfigError(
                f"sample arg {index} of graphed_step is a {type(arg).__name__}, not a "
                "tensor: a graph replays tensor inputs copied into static buffers. Pass "
                "tensors only, and bind other arguments with functools.partial or a closure"
            )
    specs = tuple(_ArgSpec.of(arg) for arg in sample_args)
    devices = list(dict.fromkeys(spec.device for spec in specs))
    if len(devices) > 1:
        raise OOOConfigError(
            f"graphed_step's sample args span several devices ({', '.join(map(str, devices))}): "
            "a graph replays the work of one device; move every input to the model's device"
        )
    return specs


def _check_outputs(outputs: Any) -> None:
    others = non_tensor_leaves(outputs, "output")
    if others:
        raise OOOConfigError(
            f"graphed_step's step_fn returned values that are not tensors: {', '.join(others)}; "
            "a replay returns the tensors the capture made, rewritten in place, so return "
            "tensors only (a Python number read from a tensor is a host sync, which a graph "
            "cannot capture)"
        )


def _capture(
    step_fn: Callable[..., Any],
    sample_args: tuple[torch.Tensor, ...],
    specs: tuple[_ArgSpec, ...],
    warmup: int,
    device: torch.device,
) -> GraphedStep:
    with torch.cuda.device(device):
        static_args = tuple(_static_copy(arg) for arg in sample_args)
        ambient = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

        def warm_up(steps: int, check: bool = False) -> None:
            # 1. The warm-up stream waits on ambient, where the clones were queued.
            side.wait_stream(ambient)
            with torch.cuda.stream(side):
                for step in range(steps):
                    outputs = step_fn(*static_args)
                    if check and step == 0:
                        _check_outputs(outputs)
                    # A kept output (the loss) keeps its autograd graph alive, and with it
                    # gradient accumulators bound to warm-up streams, stale under capture.
                    del outputs
            # 2. Ambient, and so the capture (torch.cuda.graph synchronizes first), runs
            # after the warm-up's updates to parameters and optimizer state.
            ambient.wait_stream(side)

        def capture() -> tuple[torch.cuda.CUDAGraph, Any]:
            graph = torch.cuda.CUDAGraph()
            with stale_capture_streams_overridden(), torch.cuda.graph(graph):
                outputs = step_fn(*static_args)
            return graph, outputs

        def capture_arm() -> tuple[torch.cuda.CUDAGraph, Any]:
            warm_up(1)  # the arm held now: its streams and workspaces, outside the capture
            return capture()

        with _wrapped_models_seen() as models:
            warm_up(warmup, check=True)
        try:
            race = _graph_race(models, capture_arm, shape_of(static_args, {}))
            graph, static_outputs = (None, None) if race is not None else capture()
        except Exception as error:
            raise _capture_failed(error) from error
    logger.info(
        "ooo_wrap.graphed_step: captured the step in a CUDA graph on %s after %d warm-up steps%s",
        device,
        warmup,
        "" if race is None else f"; racing the arms {', '.join(race.arms)} as graphs",
    )
    return GraphedStep(
        step_fn,
        specs,
        "captured",
        f"captured in a CUDA graph on {device}; each call copies its args in and replays",
        graph,
        static_args,
        static_outputs,
        race=race,
    )


@contextlib.contextmanager
def _wrapped_models_seen() -> Iterator[list[nn.Module]]:
    """The wrapped models the block runs, in order: each is told, as its forward starts,
    that its step is about to be captured (``registry.hold_for_graph``)."""
    models: list[nn.Module] = []

    def seen(module: nn.Module, args: Any) -> None:
        if is_wrapped(module):
            hold_for_graph(module)
            if all(module is not other for other in models):
                models.append(module)

    handle = register_module_forward_pre_hook(seen)
    try:
        yield models
    except BaseException:
        for model in models:
            let_go_of_graph(model)  # the warm-up failed: nothing will race them
        raise
    finally:
        handle.remove()


def _graph_race(models: list[nn.Module], capture_arm: Capture, shape: Shape) -> GraphRace | None:
    """Race the arms of the first tuning model the step runs as graphs; the others hold
    plain until it decides (one model is raced at a time, as in eager tuning)."""
    tuning = [(model, tuner) for model in models if (tuner := race_as_graph(model))]
    if not tuning:
        return None
    (model, tuner), others = tuning[0], [tuner for _, tuner in tuning[1:]]
    for other in others:
        other.hold(other.arms[0])  # before any capture: every graph holds it plain
        why = (
            "the step captured in a CUDA graph races another wrapped model's arms (one "
            "model at a time): the graphs hold this one plain, unmeasured as a graph"
        )
        other.log.add(OOOEvent(EventKind.TUNED, "not_finished", why), level=logging.INFO)
    return GraphRace(model, tuner, capture_arm, shape, others)


def _capture_failed(error: Exception) -> OOOError:
    return OOOError(
        f"capturing the step in a CUDA graph failed ({type(error).__name__}: "
        f"{error}). A captured step must not sync with the host: no .item(), "
        ".tolist(), print of a tensor, nonzero() or boolean-mask indexing, no "
        "data-dependent shape (an MoE that routes so cannot be captured); Adam and "
        "AdamW need capturable=True"
    )


def _static_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A buffer of the sample arg's own: the caller may free or reuse theirs."""
    copy = tensor.detach().clone()
    return copy.requires_grad_() if tensor.requires_grad else copy
