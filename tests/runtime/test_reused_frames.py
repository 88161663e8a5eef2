"""What the stage hooks reuse from call to call (frames and their events) keeps nothing
alive and orders nothing it should not: a dropped or unwrapped model is freed, on every
thread, and a join left pending waits on its own call's record of the stage's event."""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from torch import nn

import ooo_wrap
from ooo_wrap.testing import SimulatedBackend, VirtualEvent
from tests.support.models import make_two_towers, two_tower_input


def _wrapped_two_towers() -> nn.Module:
    model = make_two_towers()
    ooo_wrap.OOOModule(model, 4, backend=SimulatedBackend(), planner="static")
    return model


def test_a_dropped_wrapped_model_frees_its_stage_parameters() -> None:
    # A sweep that builds a model per trial must not keep every trial's stage weights.
    model = _wrapped_two_towers()
    model(two_tower_input()).sum().backward()
    params = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert [p() for p in params if p() is not None] == []


def test_unwrap_frees_what_another_live_thread_ran() -> None:
    # A long-lived worker thread (serving, data-parallel, the autograd engine's device
    # threads) that ran the model must not keep it alive after unwrap.
    model = _wrapped_two_towers()
    x = two_tower_input()
    ran, finish = threading.Event(), threading.Event()
    holder = [model]

    def worker() -> None:
        holder[0](x).sum().backward()
        ran.set()
        finish.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert ran.wait(30)
        params = [weakref.ref(p) for p in model.parameters()]
        ooo_wrap.unwrap(model)
        holder.clear()
        del model
        gc.collect()
        alive = sum(p() is not None for p in params)
    finally:
        finish.set()
        thread.join()
    assert alive == 0


class _EncoderTwice(nn.Module):
    """One encoder applied to two inputs; the head reads the first encoding only."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.enc(x1)
        b = self.enc(x2)
        return self.head(a), b


def test_a_pending_join_waits_on_its_own_calls_record() -> None:
    # On CUDA a wait queued after an event is recorded again waits on the new record: a
    # join left pending on the stage's reused event would make head(a) wait for enc(x2)
    # too, and the overlap deferred joins exist for would be gone.
    backend = SimulatedBackend(keep_all=True)
    model = _EncoderTwice()
    ooo_wrap.OOOModule(
        model, backend=backend, overlap_forward=True, planner="static", stages=["enc", "head"]
    )
    backend.clear_log()
    model(torch.randn(2, 4), torch.randn(2, 4))
    records: dict[VirtualEvent, int] = {}
    waits_seen: list[int] = []  # at each wait on an event, how often it had been recorded
    streams = [c.stream for c in backend.log if c.op == "set_stream" and c.stream.id != 0]
    enc_stream, head_stream = streams[0], next(s for s in streams if s != streams[0])
    for call in backend.log:
        if call.op == "record_event" and call.stream == enc_stream:
            records[call.event] = records.get(call.event, 0) + 1
        elif call.op == "wait_event" and call.stream == head_stream and call.event in records:
            waits_seen.append(records[call.event])
    assert sum(records.values()) >= 2  # enc's two joins (and the root's join, step 5)
    assert waits_seen == [1], waits_seen  # head waits on the first record, once


def test_a_re_recorded_virtual_event_is_the_same_event() -> None:
    # As a CUDA event: the checker sees a wait queued after a re-record wait on the new one.
    backend = SimulatedBackend()
    stream = backend.new_stream(torch.device("cpu"))
    first = backend.record_event(stream)
    assert backend.record_event(stream, first) is first
    other = backend.new_stream(torch.device("cpu"))
    assert backend.record_event(other, first) is not first  # another stream: a new point
