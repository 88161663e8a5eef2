"""Run a function on several CPU ranks (gloo), each in a fresh spawned process, bounded in time.

Used by ``test_ddp.py``, ``test_fsdp.py``, the weight-gradient split's ``test_ddp_wgrad.py``
and ``test_fsdp_wgrad.py``, and ``test_docs_snippets.py``. A hang fails the test after
``timeout`` seconds (every rank is killed) instead of blocking CI. The ranks' training
loop (:func:`train_history`) is shared too.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ooo_wrap.testing import SimulatedBackend

REPO_ROOT = Path(__file__).resolve().parents[2]


# torch 2.6's FSDP2 cannot run on the CPU at all: its all-gather records an event on a
# torch.cpu.Stream, which has no record_event there. FSDP2 tests need a later torch.
FSDP2_RUNS_ON_CPU = hasattr(torch.cpu.Stream, "record_event")
FSDP2_SKIP_REASON = (
    "this torch's FSDP2 cannot run on the CPU (torch.cpu.Stream has no record_event)"
)


def rank_device(rank: int, device_type: str) -> tuple[torch.device, SimulatedBackend | None]:
    """This rank's device, and the backend to wrap with there: virtual streams on the CPU
    (every rank on the one CPU device), the real accelerator on a GPU (one per rank)."""
    device = torch.device(device_type, rank if device_type == "cuda" else 0)
    return device, SimulatedBackend() if device_type == "cpu" else None


def assert_same_tensors(
    a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None], *, none_ok: bool
) -> None:
    """Same names, bitwise-equal tensors; ``None`` on both sides only where ``none_ok``."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if none_ok:
            assert (x is None) == (y is None), name
        else:
            assert x is not None and y is not None, name
        assert x is None or y is None or torch.equal(x, y), name


def full_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy on the CPU of ``tensor`` (a sharded ``DTensor`` gathered whole)."""
    if tensor is None:
        return None
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().cpu().clone()


def train_history(
    model: nn.Module,
    rank: int,
    device: torch.device,
    *,
    steps: int,
    features: int,
    call: nn.Module | None = None,
) -> list[dict[str, Any]]:
    """``steps`` SGD steps (lr 0.1) of ``model`` through ``call`` (a wrapper around it, such
    as ``DistributedDataParallel``; the model itself by default), each on a batch of 6 x
    ``features`` seeded by rank and step; returns each step's gradients and then parameters
    by name (:func:`full_tensor`)."""
    call = model if call is None else call
    optimizer = torch.optim.SGD(call.parameters(), lr=0.1)
    history = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(6, features, generator=generator).to(device)
        optimizer.zero_grad(set_to_none=True)
        call(x).pow(2).mean().backward()
        grads = {name: full_tensor(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        params = {name: full_tensor(p) for name, p in model.named_parameters()}
        history.append({"grads": grads, "params": params})
    return history


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    out: str,
    backend: str,
    args: tuple[Any, ...],
) -> None:
    result_path = Path(out) / f"rank{rank}.pt"
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        torch.set_num_threads(1)  # two ranks on two cores: no oversubscription
        import ooo_wrap

        # The ranks must test this checkout, not another install of the package.
        assert Path(ooo_wrap.__file__).resolve().is_relative_to(REPO_ROOT), ooo_wrap.__file__
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # A file rendezvous: no TCP port to pick, so no race with other jobs for one.
        store = f"file://{Path(out) / 'rendezvous'}"
        dist.init_process_group(backend, init_method=store, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, result_path)
    except BaseException:
        result_path.with_suffix(".err").write_text(traceback.format_exc())
        raise


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 60.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each result.

    ``backend`` is the process-group backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU a rank).

    ``fn`` must be importable (a module-level function of a test module) and return
    something ``torch.save`` can store. Raises ``AssertionError`` with the rank's traceback
    if a rank fails, or if the ranks are not done within ``timeout`` seconds.
    """
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        # Spawned children get this process's sys.path; PYTHONPATH covers anything they
        # start themselves, so every process imports this checkout of ooo_wrap.
        env_before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env_before]))
        try:
            procs = [
                context.Process(
                    target=_entry,
                    args=(fn, rank, world_size, out, backend, args),
                )
                for rank in range(world_size)
            ]
            for proc in procs:
                proc.start()
        finally:
            if env_before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = env_before
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        assert not hung, f"ranks {hung} still running after {timeout:.0f} s (killed)"
        errors = sorted(Path(out).glob("*.err"))
        assert not errors, "\n".join(path.read_text() for path in errors)
        codes = [proc.exitcode for proc in procs]
        assert codes == [0] * world_size, f"rank exit codes {codes}"
        return [
            torch.load(Path(out) / f"rank{rank}.pt", weights_only=False)
            for rank in range(world_size)
        ]
