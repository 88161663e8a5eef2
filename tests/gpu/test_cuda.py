"""On a CUDA GPU: parity wrapped vs plain, streams really used, fallbacks, graph capture
and the graph recipes, allocator reuse, the benchmark path.

Every test here is marked ``cuda`` and skipped on a machine without one (see conftest);
``scripts/gpu_check.sh`` runs this file first, on its own, and fails if its tests were
skipped for lack of CUDA.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ooo_wrap
from benchmarks import suite
from benchmarks.measure import GRAPHED_MODES, MODES, Point, measure_point
from benchmarks.models import ModelSpec
from examples import quickstart, transformer
from ooo_wrap import _compat
from ooo_wrap._runtime.backend import AcceleratorBackend
from tests.support.cli_factories import graph_towers

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda")
REL_TOL = 1e-6  # float32 parity, relative (per tensor, in the 2-norm)

Batch = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True)
def _exact_float32() -> Iterator[None]:
    """Both sides must run the same kernels: no TF32, no autotuning, deterministic cuDNN."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    saved = (cuda.matmul.allow_tf32, cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    cuda.matmul.allow_tf32, cudnn.allow_tf32 = False, False
    cudnn.deterministic, cudnn.benchmark = True, False
    yield
    cuda.matmul.allow_tf32, cudnn.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved


@dataclass(frozen=True)
class Case:
    """A model to compare: how to build it (on the CPU, seeded), feed it and score it."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _quickstart_batch() -> Batch:
    x = quickstart.example_input(32)
    return x, torch.randint(0, quickstart.CLASSES, (x.shape[0],))


def _transformer_batch() -> Batch:
    tokens = transformer.example_input(8)
    return tokens[:, :-1], tokens[:, 1:]


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _spec_case(spec: ModelSpec, batch: int) -> Case:
    return Case(f"bench {spec.label}", spec.build, lambda: spec.make_batch(batch), spec.loss)


CASES = [
    Case(
        "quickstart Towers",
        quickstart.build_model,
        _quickstart_batch,
        lambda out, y: F.cross_entropy(out, y),
    ),
    Case("example TinyTransformer", transformer.build_model, _transformer_batch, _token_loss),
    _spec_case(ModelSpec.towers(4, 256, 3), 8),
    _spec_case(ModelSpec.branches(4, 16, 2, 16), 4),
    _spec_case(ModelSpec.transformer(4, 128, 4, 32), 4),
]


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def _wrap_copy(plain: nn.Module) -> ooo_wrap.OOOModule:
    wrapped = ooo_wrap.OOOModule(copy.deepcopy(plain), streams=4, planner="static", tune=False)
    assert isinstance(wrapped, ooo_wrap.OOOModule), ooo_wrap.events_for(wrapped)
    return wrapped


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity_of_outputs_gradients_and_training(case: Case) -> None:
    plain = case.build().to(DEVICE)
    wrapped = _wrap_copy(plain)
    x, y = (t.to(DEVICE) for t in case.batch())
    sides = [
        (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        for model in (plain, wrapped)
    ]
    steps = 3
    for step in range(steps):
        outputs = []
        for model, optimizer in sides:
            optimizer.zero_grad(set_to_none=True)
            # The math attention kernels are deterministic; the fused ones may use atomics.
            with sdpa_kernel(SDPBackend.MATH):
                output = model(x)
            case.loss(output, y).backward()
            outputs.append(output.detach())
        torch.cuda.synchronize()
        assert _rel_err(outputs[1], outputs[0]) <= REL_TOL, f"output, step {step}"
        for (name, p), (wname, w) in zip(
            plain.named_parameters(), wrapped.named_parameters(), strict=True
        ):
            assert name == wname
            assert (p.grad is None) == (w.grad is None), name
            if p.grad is not None and w.grad is not None:
                err = _rel_err(w.grad, p.grad)
                assert err <= REL_TOL, f"grad of {name}, step {step}: {err:.2e}"
        for _, optimizer in sides:
            optimizer.step()
    for (name, p), (_, w) in zip(
        plain.state_dict().items(), wrapped.state_dict().items(), strict=True
    ):
        if p.is_floating_point():
            assert _rel_err(w, p) <= REL_TOL, f"{name} after {steps} steps"
        else:
            assert torch.equal(w, p), name
    stats = wrapped.stats
    assert stats.stage_calls == steps * len(wrapped.plan.stages)
    assert stats.bypasses == 0 and stats.failures == 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_split_weight_grads_parity_on_the_gpu(case: Case) -> None:
    # The weight-gradient split on the real engine and streams: gradients equal the plain
    # model's (the engine's own stream syncs order every dW; see docs/weight-gradients.md).
    plain = case.build().to(DEVICE)
    wrapped = ooo_wrap.OOOModule(copy.deepcopy(plain), split_weight_grads=True, tune=False)
    assert isinstance(wrapped, ooo_wrap.OOOModule), ooo_wrap.events_for(wrapped)
    x, y = (t.to(DEVICE) for t in case.batch())
    for step in range(3):  # the first forward learns the plan, inline
        for model in (plain, wrapped):
            model.zero_grad(set_to_none=True)
            with sdpa_kernel(SDPBackend.MATH):
                case.loss(model(x), y).backward()
        torch.cuda.synchronize()
        for (name, p), w in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
            assert (p.grad is None) == (w.grad is None), name
            if p.grad is not None and w.grad is not None:
                err = _rel_err(w.grad, p.grad)
                assert err <= REL_TOL, f"grad of {name}, step {step}: {err:.2e}"
    assert wrapped.stats.split_layer_calls > 0, wrapped.events


def _current_stream() -> int:
    return int(torch.cuda.current_stream(DEVICE).cuda_stream)


def test_stages_run_forward_and_backward_on_side_streams() -> None:
    model = _wrap_copy(quickstart.build_model().to(DEVICE))
    ambient = _current_stream()
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    names = [stage.name for stage in model.plan.stages]

    def on_forward(name: str) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: object) -> None:
            forward[name] = _current_stream()

        return pre_hook

    def on_output(name: str) -> Callable[..., None]:
        def backward_hook(grad: torch.Tensor) -> None:
            # Tensor hooks run inside the engine's stream guard for the node that made the
            # tensor, so this is the stream the stage's backward runs on.
            backward[name] = _current_stream()

        def post_hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            output.register_hook(backward_hook)  # returns None: the output stays as it is

        return post_hook

    for name in names:
        stage = model.get_submodule(name)
        # Registered after wrapping, so they run after the wrapper's own hooks: the pre-hook
        # sees the stage's stream, the post-hook sees the output the stage made there.
        stage.register_forward_pre_hook(on_forward(name))
        stage.register_forward_hook(on_output(name))
    x = quickstart.example_input(16).to(DEVICE)
    out = model(x)
    assert _current_stream() == ambient, "the caller's stream was not restored"
    out.sum().backward()
    torch.cuda.synchronize()

    assert set(forward) == set(names)
    assert ambient not in forward.values()
    assert len(set(forward.values())) == model.plan.num_streams
    by_index: dict[int, set[int]] = {}
    for planned in model.plan.stages:
        by_index.setdefault(planned.stream, set()).add(forward[planned.name])
    assert all(len(handles) == 1 for handles in by_index.values())
    assert backward == forward
    assert model.stats.stage_calls == len(names)


def test_the_learned_plan_runs_on_side_streams_from_the_second_step() -> None:
    torch.manual_seed(0)
    plain = quickstart.build_model().to(DEVICE)
    model = ooo_wrap.OOOModule(copy.deepcopy(plain), streams=4, tune=False)  # dataflow
    assert isinstance(model, ooo_wrap.OOOModule) and model.plan.pending
    x = quickstart.example_input(16).to(DEVICE)
    for step in range(3):
        model(x).sum().backward()
        plain(x).sum().backward()
        if step == 0:
            assert model.plan.stages and model.stats.stage_calls == 0  # learned inline
    torch.cuda.synchronize()
    assert model.stats.stage_calls == 2 * len(model.plan.stages)
    for (name, w), (_, p) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert w.grad is not None and p.grad is not None
        assert torch.equal(w.grad, p.grad), name


def test_profiler_sees_kernels_on_the_side_streams(tmp_path: Path) -> None:
    spec = ModelSpec.towers(4, 512, 3)
    model = _wrap_copy(spec.build().to(DEVICE))
    x, y = spec.make_batch(16, DEVICE)
    spec.loss(model(x), y).backward()  # warm-up: lazy initialisation stays out of the trace
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        spec.loss(model(x), y).backward()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if str(e.get("cat", "")).lower() == "kernel"]
    if not kernels:
        pytest.skip("the profiler recorded no CUDA kernels on this machine (CUPTI unavailable?)")
    streams = {e["args"]["stream"] for e in kernels if "stream" in e.get("args", {})}
    # Side streams for the towers, plus the caller's for the sum and the loss.
    assert len(streams) >= model.plan.num_streams + 1, streams


def test_cpu_model_falls_back_even_with_cuda_present() -> None:
    model = quickstart.build_model()
    result: nn.Module = ooo_wrap.OOOModule(model, streams=4, planner="static")
    assert result is model
    assert type(result) is quickstart.Towers
    assert [(e.kind, e.reason) for e in ooo_wrap.events_for(result)] == [
        (ooo_wrap.EventKind.DISABLED, "cpu")
    ]


def test_single_stage_model_on_cuda_falls_back() -> None:
    model = nn.Sequential(nn.Linear(8, 8)).to(DEVICE)
    result: nn.Module = ooo_wrap.OOOModule(model, streams=4, planner="static")
    assert result is model and not isinstance(result, ooo_wrap.OOOModule)
    assert ooo_wrap.events_for(result)[-1].reason == "too_few_stages"


def test_disabled_runs_stages_inline_on_the_callers_stream() -> None:
    model = _wrap_copy(quickstart.build_model().to(DEVICE))
    ambient = _current_stream()
    seen: list[int] = []

    def pre_hook(module: nn.Module, args: object) -> None:
        seen.append(_current_stream())

    for stage in model.plan.stages:
        model.get_submodule(stage.name).register_forward_pre_hook(pre_hook)
    with ooo_wrap.disabled():
        model(quickstart.example_input(4).to(DEVICE)).sum().backward()
    assert seen and set(seen) == {ambient}
    assert model.stats.stage_calls == 0
    assert model.stats.bypasses == len(model.plan.stages)
    assert any(e.reason == "disabled" for e in model.events)


class _Raises(nn.Module):
    """A stage (it has parameters) whose forward always raises."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


class _Fragile(nn.Module):
    """Two stages; the second one raises."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([nn.Linear(8, 8), _Raises()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stages[1](self.stages[0](x))
        return out


def test_stage_failure_restores_the_stream_and_training_continues() -> None:
    model = _wrap_copy(_Fragile().to(DEVICE))
    ambient = _current_stream()
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    assert _current_stream() == ambient
    assert any(e.kind is ooo_wrap.EventKind.STAGE_FAILED for e in model.events)
    assert model.stats.failures == 1
    # The stage that did not raise still trains afterwards, and the stream is restored.
    calls = model.stats.stage_calls
    model.get_submodule("stages.0")(x).sum().backward()
    torch.cuda.synchronize()
    assert _current_stream() == ambient
    assert model.stats.stage_calls == calls + 1


def test_unwrap_on_cuda_restores_the_model() -> None:
    model = _wrap_copy(quickstart.build_model().to(DEVICE))
    x = quickstart.example_input(4).to(DEVICE)
    model(x).sum().backward()
    plain = model.unwrap()
    assert type(plain) is quickstart.Towers
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in plain.modules())
    plain(x).sum().backward()
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_point_on_cuda(dtype: str) -> None:
    point = Point(ModelSpec.towers(4, 256, 2), 8, dtype)  # type: ignore[arg-type]
    record = measure_point(point, DEVICE, warmup=1, steps=3, mem_steps=2)
    plain, wrapped = record["plain"], record["wrapped"]
    assert wrapped["active"], wrapped["events"]
    assert plain["peak_memory_bytes"] > 0 and wrapped["peak_memory_bytes"] > 0
    assert wrapped["peak_reserved_bytes"] >= 0  # may be 0: segments held already can serve
    assert math.isfinite(record["speedup"]) and record["speedup"] > 0
    assert record["memory_ratio"] > 0
    per_step = wrapped["stats_per_step"]
    assert per_step["stage_calls"] == 4 and per_step["waits"] == 4
    assert per_step["record_streams"] == 8  # each tower: its input and its output
    assert len(plain["warmup_ms"]) == 1 and len(plain["first_steps_ms"]) == 2
    if dtype == "float32":
        assert abs(wrapped["final_loss"] - plain["final_loss"]) <= REL_TOL * abs(
            plain["final_loss"]
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_point_graphed_modes_capture_on_cuda(dtype: str) -> None:
    # The suite's whole-step CUDA graphs (ooo_wrap.graphed_step): both graphed modes
    # capture and replay, and the wrapper's counters around the captured step show its
    # stages forked onto side streams inside the capture, none inline.
    point = Point(ModelSpec.fanout(4, 64, 2), 8, dtype)  # type: ignore[arg-type]
    record = measure_point(
        point, DEVICE, warmup=1, steps=3, mem_steps=2, modes=MODES, graph_warmup=2
    )
    assert record["failed_modes"] == {} and record["out_of_memory_modes"] == []
    for mode in GRAPHED_MODES:
        side = record[mode]
        assert side["captured"] and side["capture_ms"] > 0 and side["median_ms"] > 0
        assert side["graph_warmup_ms"] > 0
        assert math.isfinite(side["final_loss"]) and side["peak_memory_bytes"] > 0
    graphed = record["wrapped_graphed"]
    assert graphed["active"], graphed["events"]
    assert graphed["stages"] > 0
    assert graphed["capture_bypasses"] == 0
    assert graphed["wrapper_in_capture"] == "side streams"
    # One training step captured: as many stage calls forked as an eager wrapped step
    # makes (same model, same planner, so the same learned plan).
    assert graphed["capture_stage_calls"] == record["wrapped"]["stats_per_step"]["stage_calls"]
    assert graphed["capture_stage_calls"] > 0
    assert record["wrapped_overlap"]["active"] and record["graphed_speedup"] > 0


def test_suite_on_cuda_writes_json_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    status = suite.main(
        [
            "--models", "towers,transformer", "--dtypes", "float32",
            "--towers", "2", "--towers-width", "128", "--towers-depth", "2",
            "--towers-batches", "4,8", "--towers-widths", "64",
            "--transformer-batches", "2",
            "--warmup", "1", "--steps", "2", "--mem-steps", "1",
            "--overhead-repeats", "2", "--overhead-calls", "5",
            "--json", str(path), "--no-plot",
        ]
    )  # fmt: skip
    assert status == 0
    report = json.loads(path.read_text())
    assert report["kind"] == "gpu" and report["environment"]["gpu"]
    assert [r["batch"] for r in report["results"]] == [4, 8, 4, 2]
    assert all(r["wrapped"]["active"] for r in report["results"])
    out = capsys.readouterr().out
    assert "| model |" in out and "Targets" in out


def test_calibration_times_the_gemm_pairs_on_two_streams() -> None:
    from benchmarks import calibrate

    pairs = calibrate._concurrent_gemms(DEVICE, calls=2, repeats=1)
    assert len(pairs) == 2 * len(calibrate.GEMM_SHAPES)
    for pair in pairs:
        assert pair["serial_ms"] > 0 and pair["concurrent_ms"] > 0
        assert pair["measured_overlap"] == pair["serial_ms"] / pair["concurrent_ms"]
        assert pair["estimated_overlap"] >= 1.0


class _NoCaptureQuery:
    """A stream as torch 2.6 to 2.11 show it: no ``is_capturing`` method."""

    def __init__(self, stream: torch.Stream) -> None:
        self.device = stream.device


@pytest.mark.parametrize("stream_api", ["as installed", "without Stream.is_capturing"])
def test_a_real_capture_is_detected(stream_api: str) -> None:
    # What keeps the dataflow planner from learning inside a capture; on torch 2.11 the
    # CUDA-only query answers.
    static = torch.ones(4, device=DEVICE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.accelerator.current_stream(DEVICE)
        query = stream if stream_api == "as installed" else _NoCaptureQuery(stream)
        capturing = _compat.stream_is_capturing(query)
        static.add_(1)
    assert capturing
    assert not _compat.stream_is_capturing(torch.accelerator.current_stream(DEVICE))


def test_capturing_a_wrapped_forward_in_a_graph_forks_onto_side_streams() -> None:
    # A no_grad forward with overlap_forward keeps its side streams; under capture the
    # stages fork and join exactly as in eager (they used to run inline there), and the
    # root join brings every side stream back before the capture ends.
    plain = quickstart.build_model().to(DEVICE)
    model = ooo_wrap.OOOModule(
        copy.deepcopy(plain), streams=4, planner="static", overlap_forward=True, tune=False
    )
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    static_x = quickstart.example_input(8).to(DEVICE)
    warmup = torch.cuda.Stream(DEVICE)  # capture wants lazy initialisation done elsewhere
    warmup.wait_stream(torch.cuda.current_stream(DEVICE))
    with torch.no_grad(), torch.cuda.stream(warmup):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream(DEVICE).wait_stream(warmup)
    calls = model.stats.stage_calls
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = model(static_x)
    assert model.stats.stage_calls == calls + len(model.plan.stages)
    assert model.stats.bypasses == 0
    assert not [e for e in model.events if e.kind is ooo_wrap.EventKind.BYPASSED]
    new_x = quickstart.example_input(8).to(DEVICE) * 2
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        expected = plain(new_x)
    assert _rel_err(static_out, expected) <= REL_TOL


class _Offset(nn.Module):
    """A stage whose output is a fresh tensor: its input plus a zero parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


class _TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleList([_Offset(), _Offset()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.stages[1](self.stages[0](x))
        return out


class _WithoutOutputRecordStream(AcceleratorBackend):
    """The real backend minus the outputs' ``record_stream`` to the caller's stream."""

    def __init__(self, caller: torch.Stream) -> None:
        self.caller = caller

    def record_stream(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        if (stream.device_index, stream.stream_id) == (
            self.caller.device_index,
            self.caller.stream_id,
        ):
            return  # the bug, on purpose: the allocator never hears the caller uses it
        super().record_stream(tensor, stream)


SLEEP_CYCLES = 200_000_000  # about 0.1 s at an H200's clock: far longer than the rest
OUTPUT_NUMEL = (1 << 20) + 4096  # an unusual size, so no other free block fits it better


@pytest.mark.parametrize("output_record_stream", ["kept", "removed"])
def test_a_dropped_stage_output_is_not_reused_while_the_caller_still_reads_it(
    output_record_stream: str,
) -> None:
    # The stage's output is allocated on its side stream, so when the caller drops it the
    # block returns to the side stream's pool. Only record_stream(caller) stops the side
    # stream from reusing it while the caller's (delayed) read is still queued; the CUDA
    # Stream Sanitizer cannot see this, so the values are checked.
    ambient = torch.cuda.current_stream(DEVICE)
    backend = AcceleratorBackend()
    if output_record_stream == "removed":
        backend = _WithoutOutputRecordStream(ambient)
    model = ooo_wrap.OOOModule(
        _TwoStages().to(DEVICE), streams=2, backend=backend, planner="static", tune=False
    )
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    stage = model.get_submodule("stages.0")
    seen: list[torch.cuda.Stream] = []
    stage.register_forward_pre_hook(lambda m, a: seen.append(torch.cuda.current_stream(DEVICE)))
    with torch.no_grad():
        x = torch.ones(OUTPUT_NUMEL, device=DEVICE)
        torch.cuda.synchronize()
        y = stage(x)  # made on the side stream, joined back into the caller's
        (side,) = seen
        assert side != ambient
        block = y.data_ptr()
        torch.cuda._sleep(SLEEP_CYCLES)  # private, test-only: a stream that lags behind
        doubled = y * 2  # queued on the caller's stream behind the sleep
        del y  # the caller drops the stage's output
        with torch.cuda.stream(side):
            other = torch.empty(OUTPUT_NUMEL, device=DEVICE)  # runs at once: side is idle
            other.fill_(-1.0)
        torch.cuda.synchronize()
    reused = other.data_ptr() == block
    correct = torch.equal(doubled, torch.full_like(doubled, 2.0))
    if output_record_stream == "kept":
        assert correct and not reused
    else:
        # The stress test can fail: without the record the block is reused at once and
        # overwritten before the caller's read.
        assert reused, "the allocator did not reuse the block: this test shows nothing"
        assert not correct, "the dropped output was reused, yet the caller read it intact"


# --- the CUDA graph recipes: ooo_wrap.graphed_step, ooo_wrap.make_graphed_callables ------

GRAPH_REPLAYS = 100
# float32 over a hundred optimizer steps: the same kernels on both sides, but each side
# stream has its own cuBLAS workspace, which may pick another algorithm, and Adam turns a
# last-bit difference in a near-zero gradient into a step of up to the learning rate. A
# missing join or a stale input reads garbage, far outside this.
GRAPH_REL_TOL = 1e-3


def _graph_batches(count: int) -> list[Batch]:
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    return [
        (
            torch.randn(32, quickstart.IN_FEATURES, device=DEVICE, generator=generator),
            torch.randint(0, quickstart.CLASSES, (32,), device=DEVICE, generator=generator),
        )
        for _ in range(count)
    ]


def _adam_step(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    # capturable=True: Adam keeps its step count on the device, as a captured step needs.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def _stages_ran_on_side_streams_in_capture(model: nn.Module) -> None:
    """No stage call of the model ran inline: none bypassed, whatever the reason."""
    bypassed = [e for e in ooo_wrap.events_for(model) if e.kind is ooo_wrap.EventKind.BYPASSED]
    assert bypassed == [], bypassed
    stats = model.stats
    assert stats.bypasses == 0 and stats.failures == 0, stats


def _assert_parameters_close(plain: nn.Module, model: nn.Module, steps: int) -> None:
    for (name, p), (_, w) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert torch.isfinite(w).all(), name
        assert _rel_err(w, p) <= GRAPH_REL_TOL, f"{name} after {steps} steps"


def test_graphed_step_of_a_wrapped_model_matches_eager_steps_of_the_plain_one() -> None:
    plain = quickstart.build_model().to(DEVICE)
    model = ooo_wrap.OOOModule(copy.deepcopy(plain), streams=4, tune=False)  # dataflow
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    sample, *batches = _graph_batches(1 + GRAPH_REPLAYS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed = ooo_wrap.graphed_step(_adam_step(model), *sample, warmup=3)
    assert graphed.captured and graphed.reason == "captured", graphed.message
    assert graphed.graph is not None and len(graphed.static_args) == 2
    stream_warnings = [
        str(w.message)
        for w in caught
        if "AccumulateGrad" in str(w.message) or "stale" in str(w.message)
    ]
    assert stream_warnings == []  # the warm-up left no accumulator on a stale stream
    stages = len(model.plan.stages)
    assert stages >= 2, model.plan
    # Warm-up step 1 learned the plan inline; steps 2 and 3 and the capture forked every
    # stage onto its side stream.
    assert model.stats.stage_calls == 3 * stages, model.stats
    _stages_ran_on_side_streams_in_capture(model)

    eager = _adam_step(plain)
    expected = [eager(*sample) for _ in range(3)]  # the warm-up steps are real steps
    expected += [eager(*batch) for batch in batches]
    losses = [graphed(*batch).clone() for batch in batches]  # the output is rewritten
    torch.cuda.synchronize()
    assert model.stats.stage_calls == 3 * stages  # a replay runs no hook
    for replay, (loss, want) in enumerate(zip(losses, expected[3:], strict=True)):
        assert torch.isfinite(loss), f"replay {replay}"
        assert _rel_err(loss, want) <= GRAPH_REL_TOL, f"loss of replay {replay}"
    _assert_parameters_close(plain, model, 3 + GRAPH_REPLAYS)


def test_graphed_step_races_the_arms_as_graphs_and_trains_as_eager_steps_do() -> None:
    plain = graph_towers().to(DEVICE)
    model = ooo_wrap.OOOModule(copy.deepcopy(plain), streams=4)  # tunes: arms raced as graphs
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    generator = torch.Generator(device=DEVICE).manual_seed(2)
    batches = [
        (
            torch.randn(16, 256, device=DEVICE, generator=generator),
            torch.randint(0, 10, (16,), device=DEVICE, generator=generator),
        )
        for _ in range(1 + GRAPH_REPLAYS)
    ]
    sample, *rest = batches
    graphed = ooo_wrap.graphed_step(_adam_step(model), *sample, warmup=3)
    racing = graphed.racing
    assert graphed.captured and len(racing) >= 2 and racing[0] == "plain", (racing, model.plan)
    not_captured = [e for e in ooo_wrap.events_for(model) if e.reason == "not_captured"]
    assert not_captured == []
    assert model.tuning is not None and not any(arm.step_ms for arm in model.tuning.arms)
    eager = _adam_step(plain)
    # The warm-up steps, then one eager step per arm before its capture: real steps.
    expected = [eager(*sample) for _ in range(3 + len(racing))]
    expected += [eager(*batch) for batch in rest]
    losses = [graphed(*batch).clone() for batch in rest]
    torch.cuda.synchronize()
    for replay, (loss, want) in enumerate(zip(losses, expected[3 + len(racing) :], strict=True)):
        assert _rel_err(loss, want) <= GRAPH_REL_TOL, f"loss of replay {replay}"
    _assert_parameters_close(plain, model, len(expected))
    tuning = model.tuning
    assert tuning is not None and tuning.as_graph and any(arm.step_ms for arm in tuning.arms)


def test_graphed_step_races_the_target_towers_stage_arms_as_graphs() -> None:
    # The docs' target case (8 towers, width 2048, batch 16): host-bound in eager
    # launches, priced as a graph replay its stage arms are candidates, raced as graphs.
    from benchmarks.models import Towers

    torch.manual_seed(0)
    model = ooo_wrap.OOOModule(Towers(8, 2048, 4).to(DEVICE), streams=4)
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    x = torch.randn(16, 2048, device=DEVICE)
    y = torch.randint(0, 2048, (16,), device=DEVICE)
    graphed = ooo_wrap.graphed_step(_adam_step(model), x, y, warmup=3)
    assert model.plan.estimate is not None and model.plan.estimate.graphed, model.plan
    stage_arms = [name for name in graphed.racing if name not in ("plain", "wgrad")]
    assert stage_arms, graphed.racing
    assert [e for e in ooo_wrap.events_for(model) if e.reason == "not_captured"] == []
    for _ in range(GRAPH_REPLAYS):
        graphed(x, y)
    torch.cuda.synchronize()
    tuning = model.tuning
    assert tuning is not None and tuning.as_graph, tuning
    assert all(len(tuning.arm(name).step_ms) > 0 for name in stage_arms), str(tuning)  # type: ignore[union-attr]


def test_make_graphed_callables_takes_a_wrapped_model_and_runs_its_stages_on_side_streams() -> None:
    plain = quickstart.build_model().to(DEVICE)
    model = ooo_wrap.OOOModule(copy.deepcopy(plain), streams=4, tune=False)  # dataflow
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    (x, _), *batches = _graph_batches(1 + GRAPH_REPLAYS)
    with pytest.raises(AssertionError, match="Modules must not have hooks registered"):
        torch.cuda.make_graphed_callables(model, (x,))  # PyTorch's own function alone
    graphed = ooo_wrap.make_graphed_callables(model, (x,), num_warmup_iters=3)
    assert graphed is model  # PyTorch graphs a module's forward in place
    stages = len(model.plan.stages)
    assert not model.plan.pending and stages >= 2, model.plan
    # One eager forward learned the plan (inline), then PyTorch's three warm-up forwards
    # and its forward capture forked every stage onto its side stream.
    assert model.stats.stage_calls == 4 * stages, model.stats
    _stages_ran_on_side_streams_in_capture(model)
    assert model._forward_pre_hooks and model._forward_hooks  # the root hooks are back

    sides = [(m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)) for m in (plain, model)]
    losses: list[list[torch.Tensor]] = [[], []]
    for x, y in batches:
        for (m, optimizer), recorded in zip(sides, losses, strict=True):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            optimizer.step()
            recorded.append(loss.detach())
    torch.cuda.synchronize()
    assert model.stats.stage_calls == 4 * stages  # replays run no stage hook
    assert model.stats.forwards >= GRAPH_REPLAYS  # the root hooks still count forwards
    kinds = {e.kind for e in model.events}
    assert ooo_wrap.EventKind.STAGE_NOT_CALLED not in kinds  # expected of a graphed forward
    for step, (loss, want) in enumerate(zip(losses[1], losses[0], strict=True)):
        assert torch.isfinite(loss), f"step {step}"
        assert _rel_err(loss, want) <= GRAPH_REL_TOL, f"loss of step {step}"
    _assert_parameters_close(plain, model, GRAPH_REPLAYS)


def test_every_arm_trains_as_the_plain_model_on_the_gpu() -> None:
    # Each candidate arm pinned (nothing raced): its gradients are plain's, on the GPU.
    plain = quickstart.build_model().to(DEVICE)
    x = quickstart.example_input(32).to(DEVICE)
    probe = ooo_wrap.OOOModule(copy.deepcopy(plain), tune_arm="plain")
    probe(x).pow(2).mean().backward()
    from ooo_wrap._wrapper.registry import wrapped

    names = [arm.name for arm in wrapped[probe].arms if arm.name != "plain"]
    assert names, ooo_wrap.events_for(probe)
    plain(x).pow(2).mean().backward()
    for name in names:
        model = ooo_wrap.OOOModule(copy.deepcopy(plain), tune_arm=name)
        model.zero_grad(set_to_none=True)
        for _ in range(2):  # the learning forward, then the arm
            model.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
        for (key, p), (_, w) in zip(
            plain.named_parameters(), model.named_parameters(), strict=True
        ):
            assert p.grad is not None and w.grad is not None
            assert _rel_err(w.grad, p.grad) <= REL_TOL, (name, key)


def test_tuning_decides_on_the_towers_model_with_at_most_one_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tuning times the real steps with timing events; the host waits at most once (at the
    # cap, if the evidence stays unclear). Whatever it decides, training is plain training.
    syncs: list[object] = []
    synchronize = ooo_wrap._runtime.backend.AcceleratorClock.synchronize

    def counted(self: object, mark: object) -> None:
        syncs.append(mark)
        synchronize(self, mark)  # type: ignore[arg-type]

    monkeypatch.setattr(ooo_wrap._runtime.backend.AcceleratorClock, "synchronize", counted)
    plain = quickstart.build_model().to(DEVICE)
    model = ooo_wrap.OOOModule(copy.deepcopy(plain), streams=4, planner="static", tune=True)
    assert isinstance(model, ooo_wrap.OOOModule), ooo_wrap.events_for(model)
    x = quickstart.example_input(32).to(DEVICE)
    sides = [(m, torch.optim.SGD(m.parameters(), lr=0.01)) for m in (plain, model)]
    for _ in range(80):
        for net, optimizer in sides:
            optimizer.zero_grad(set_to_none=True)
            net(x).pow(2).mean().backward()
            optimizer.step()
        assert model.tuning is not None
        if model.tuning.decision != "pending":
            break
    tuning = model.tuning
    assert tuning is not None and tuning.decision in {arm.name for arm in tuning.arms}, tuning
    assert len(syncs) <= 2  # at most one per round: the race and the confirmation
    assert tuning.device == torch.cuda.get_device_name(DEVICE)
    kinds = {(e.kind, e.reason) for e in model.events}
    assert (ooo_wrap.EventKind.TUNED, "kept") in kinds or (
        ooo_wrap.EventKind.DISABLED,
        "measured_slower",
    ) in kinds
    torch.cuda.synchronize()
    for (name, p), (_, w) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p, w), name
