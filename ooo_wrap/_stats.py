"""Counters of what the scheduler did; a frozen snapshot for users."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Counters", "OOOStats"]


@dataclass(frozen=True)
class OOOStats:
    """Counts since wrapping; calls run under ``torch.compile`` are not counted.

    Attributes:
        forwards: calls of the wrapped model's ``forward``.
        stage_calls: stage calls run on a side stream.
        waits: stage streams made to wait on the caller's stream (one per stage call).
        record_streams: ``Tensor.record_stream`` calls on stage inputs and outputs.
        joins: caller's stream made to wait on a stage stream (per stage call and at the
            end of each forward).
        bypasses: stage calls run inline on the caller's stream (see ``BYPASSED`` events).
        failures: stage calls that raised.
        split_layer_calls: layer calls whose weight gradient ran on the weight-gradient
            stream (``split_weight_grads``).
        split_step_asides: calls of split layers that ran the stock layer instead (see
            the ``BYPASSED`` events ``weight_grads_*``); under ``torch.compile`` not counted.
    """

    forwards: int = 0
    stage_calls: int = 0
    waits: int = 0
    record_streams: int = 0
    joins: int = 0
    bypasses: int = 0
    failures: int = 0
    split_layer_calls: int = 0
    split_step_asides: int = 0


class Counters:
    """The mutable counterpart of :class:`OOOStats`, bumped on the hot path."""

    __slots__ = tuple(f.name for f in fields(OOOStats))

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    forwards: int
    stage_calls: int
    waits: int
    record_streams: int
    joins: int
    bypasses: int
    failures: int
    split_layer_calls: int
    split_step_asides: int

    def snapshot(self) -> OOOStats:
        return OOOStats(**{name: getattr(self, name) for name in self.__slots__})
