"""Where one training step of a tuning model ends, and whose turn it is to be timed.

A training step is one iteration of the user's loop. It starts at the first training
forward after a step of *the model's optimizer*: the first ``torch.optim`` optimizer
holding one of the model's parameters to step while it tunes (``torch.optim``'s global
step hook tells). Steps of other optimizers (a GAN's discriminator's, between the
generator's two forwards) do not end it. A model no optimizer updates (frozen) falls back
to any optimizer's steps; a loop with no optimizer step, to every training forward.

One model is timed at a time in a process: a step of one model holds the work of every
other model the loop runs, so while one tunes, the others run untimed (a model that
stops training for a while gives its turn away after ``IDLE_FORWARDS`` forwards of
others).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["IDLE_FORWARDS", "StepBounds", "Turns"]

IDLE_FORWARDS = 8

# Optimizer steps run in the process, counted by torch.optim's global step hook, which
# also tells each tuning model's bounds (held weakly) which optimizer stepped.
_optimizer_steps = 0
_optimizer_hook: RemovableHandle | None = None
_bounds: weakref.WeakSet[StepBounds] = weakref.WeakSet()


def _count_optimizer_step(optimizer: Optimizer, args: object, kwargs: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    for bounds in tuple(_bounds):
        bounds.optimizer_stepped(optimizer)


class StepBounds:
    """The step boundaries of one model (held weakly)."""

    def __init__(self, model: nn.Module) -> None:
        global _optimizer_hook
        self._model = weakref.ref(model)
        self._own_optimizer: weakref.ref[Optimizer] | None = None
        self._own_steps = 0
        self._own_steps_at_mark = 0
        if _optimizer_hook is None:
            _optimizer_hook = register_optimizer_step_post_hook(_count_optimizer_step)
        _bounds.add(self)
        self._optimizer_steps_at_start = _optimizer_steps
        self._optimizer_steps_at_mark = _optimizer_steps

    def close(self) -> None:
        _bounds.discard(self)

    @property
    def optimizer(self) -> str | None:
        """The type of the model's optimizer, once one stepped."""
        own = self._own_optimizer() if self._own_optimizer is not None else None
        return None if own is None else type(own).__qualname__

    def marked(self) -> None:
        """A step starts now."""
        self._optimizer_steps_at_mark = _optimizer_steps
        self._own_steps_at_mark = self._own_steps

    def continues(self) -> bool:
        """Whether a training forward now belongs to the step in flight: the model's
        optimizer has not stepped since its mark; or, while no optimizer updating the model
        is known, no optimizer at all, while the loop has run some (else every forward is a
        step)."""
        if self._own_optimizer is not None and self._own_optimizer() is not None:
            return self._own_steps == self._own_steps_at_mark
        stepped = _optimizer_steps != self._optimizer_steps_at_start
        return stepped and _optimizer_steps == self._optimizer_steps_at_mark

    def optimizer_stepped(self, optimizer: Optimizer) -> None:
        """``optimizer`` stepped: count it if it is the model's optimizer. The first to
        step holding one of the model's parameters becomes the model's (again if that one
        is freed: a loop that makes a new optimizer)."""
        if self._own_optimizer is None or self._own_optimizer() is None:
            model = self._model()
            ours = {id(param) for param in model.parameters()} if model is not None else set()
            groups = optimizer.param_groups
            if not any(id(param) in ours for group in groups for param in group["params"]):
                return
            self._own_optimizer = weakref.ref(optimizer)
        elif self._own_optimizer() is not optimizer:
            return
        self._own_steps += 1


class Turns:
    """Whose turn it is to be timed, process-wide: one holder, and training forwards of
    others since its last."""

    _holder: weakref.ref[object] | None = None
    _idle = 0

    @classmethod
    def mine(cls, me: object, lost: Callable[[object], None]) -> bool:
        """Whether ``me`` may time this step: its turn, or a free or idle one (``lost`` is
        called with a holder that loses it: its open step held this model's work)."""
        holder = cls._holder() if cls._holder is not None else None
        if holder is me:
            cls._idle = 0
            return True
        if holder is None or cls._idle >= IDLE_FORWARDS:
            cls._holder, cls._idle = weakref.ref(me), 0
            if holder is not None:
                lost(holder)
            return True
        cls._idle += 1
        return False

    @classmethod
    def give_back(cls, me: object) -> None:
        if cls._holder is not None and cls._holder() is me:
            cls._holder = None
