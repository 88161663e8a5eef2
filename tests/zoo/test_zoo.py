"""The zoo: ``check()`` over the architectures a user would try, opt-in (``pytest -m zoo``).

Each model is built offline at a tiny size with random weights: transformers models from
their configs (``tests/zoo/hf.py``, needs the ``zoo`` extra), CNNs as hand-written
replicas of torchvision/timm block structure (``tests/zoo/cnn.py``; torchvision's wheel
here breaks the CPU torch). Each case runs ``check()`` twice from the same seed and must
give the same findings both times (stable) and none at all (clean, bitwise parity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from ooo_wrap._wrapper.options import Planner
from ooo_wrap.testing import CaptureError, CheckReport, check
from tests.support.reference import FREE_FORK
from tests.zoo import cnn

pytestmark = pytest.mark.zoo

Build = Callable[[], tuple[nn.Module, tuple[Any, ...]]]


@dataclass(frozen=True)
class Case:
    """One zoo entry: how to build it, how to train it, which stages to check."""

    name: str
    build: Build
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    stages: tuple[str, ...] | None = None
    streams: int = 4
    # A chain has nothing for the dataflow planner to overlap (it runs plain, unchecked):
    # its static plan, every top-level block a stage, is checked instead.
    planner: Planner = "dataflow"


def _images(size: int = 32) -> tuple[torch.Tensor]:
    return (torch.randn(2, 3, size, size),)


def _cnn(factory: Callable[[], nn.Module], size: int = 32) -> Build:
    return lambda: (factory(), _images(size))


def _first(output: Any) -> torch.Tensor:
    """GoogLeNet's loss: the main logits plus the auxiliary head's, as its training does."""
    main, aux = output
    return main.pow(2).mean() + (0 if aux is None else 0.3 * aux.pow(2).mean())


_BRANCHES = ("branch1", "branch2", "branch3", "branch4")

CNN_CASES = [
    Case("resnet (replica)", _cnn(cnn.ResNet)),
    Case(
        "inception (replica)",
        _cnn(
            lambda: nn.Sequential(cnn.conv_bn(3, 16), cnn.Inception(16, 4), cnn.Inception(16, 4)),
            16,
        ),
    ),
    Case(
        "inception branches (replica)",
        _cnn(
            lambda: nn.Sequential(cnn.conv_bn(3, 16), cnn.Inception(16, 4), cnn.Inception(16, 4)),
            16,
        ),
        stages=tuple(f"{block}.{b}" for block in ("1", "2") for b in _BRANCHES),
    ),
    Case("googlenet with aux head (replica)", _cnn(cnn.GoogLeNet), loss_fn=_first),
    Case("hrnet (replica)", _cnn(cnn.HRNet)),
    Case(
        "hrnet branches (replica)",
        _cnn(cnn.HRNet),
        stages=("stage2.branches.0", "stage2.branches.1", "stage3.branches.0", "stage3.branches.1"),
    ),
    Case(
        "hrnet fuse in linear layers",
        lambda: (cnn.LinearFuse(), (torch.randn(4, 8),)),
        stages=("branches.0", "branches.1"),
        streams=2,
    ),
    Case("squeezenet (replica)", _cnn(cnn.SqueezeNet)),
    Case(
        "squeezenet fire expands (replica)",
        _cnn(cnn.SqueezeNet),
        stages=tuple(f"features.{i}.expand{k}" for i in (2, 3, 5) for k in ("1x1", "3x3")),
    ),
    Case("densenet (replica)", _cnn(cnn.DenseNet), planner="static"),
    Case("mobilenet_v2 (replica)", _cnn(cnn.MobileNetV2), planner="static"),
    Case("efficientnet (replica)", _cnn(cnn.EfficientNet), planner="static"),
]


def _hf(name: str) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        pytest.importorskip("transformers", reason="the zoo extra: pip install ooo-wrap[zoo]")
        from tests.zoo import hf

        model, inputs = hf.BUILDERS[name]()
        return model.train(), inputs

    return build


def _hf_loss(output: Any) -> torch.Tensor:
    from tests.zoo import hf

    return hf.loss_of(output)


HF_NAMES = [
    "bert",
    "bert-checkpoint-reentrant",
    "bert-checkpoint",
    "distilbert",
    "gpt2",
    "llama",
    "t5-labels",
    "switch-transformers-labels",
    "bart-labels",
    "whisper-labels",
    "vit",
    "clip",
    "qwen2-moe",
    "mixtral",
]
HF_CASES = [Case(name, _hf(name), loss_fn=_hf_loss) for name in HF_NAMES]
HF_CASES.append(
    Case(
        "qwen2-moe shared and routed experts",
        _hf("qwen2-moe"),
        loss_fn=_hf_loss,
        stages=tuple(
            f"model.model.layers.{i}.mlp.{part}"
            for i in (0, 1)
            for part in ("shared_expert", "experts")
        ),
        streams=2,
    )
)
HF_CASES.append(
    Case(
        "switch-transformers experts",
        _hf("switch-transformers-labels"),
        loss_fn=_hf_loss,
        stages=tuple(f"model.encoder.block.1.layer.1.mlp.experts.expert_{i}" for i in range(4)),
    )
)
HF_CASES.append(
    Case(
        "clip towers",
        _hf("clip"),
        loss_fn=_hf_loss,
        stages=("model.text_model", "model.vision_model"),
        streams=2,
    )
)

CASES = [pytest.param(case, id=case.name) for case in CNN_CASES + HF_CASES]


# Structure only: at these tiny sizes no fork pays on a real GPU; with a near-free fork
# (FREE_FORK) the dataflow planner learns the parallel structure of the architecture, and
# check() proves every candidate arm, each learned with every region the region rule finds
# (the simulated step of a tiny model pays for none).


def _run(case: Case, *, capture: bool = False) -> CheckReport:
    torch.manual_seed(0)
    model, inputs = case.build()
    return check(
        model,
        *inputs,
        loss_fn=case.loss_fn,
        streams=case.streams,
        stages=list(case.stages) if case.stages is not None else None,
        steps=2,
        planner=case.planner,
        capture=capture,
        gpu=FREE_FORK,
    )


def _findings(report: CheckReport) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    return (
        tuple(str(race) for race in report.races),
        tuple(str(hazard) for hazard in report.allocator_hazards),
        tuple(entry.name for entry in report.parity if not entry.exact),
    )


@pytest.mark.parametrize("case", CASES)
def test_zoo_model_is_clean_and_stable(case: Case) -> None:
    first = _run(case)
    second = _run(case)
    assert _findings(first) == _findings(second), f"verdict flips between runs:\n{first}\n{second}"
    assert first.ops and sum(row.backward for row in first.ops) > 0
    assert first.ok, str(first)


# Training steps that cannot be captured in a CUDA graph, as the simulated capture finds:
# each makes the host wait for the device inside the step (Switch routes its tokens by
# boolean masks, whose size depends on the data; its one_hot router is fine; for BART,
# given an attention mask, transformers' masking utilities ask on the host whether the
# mask pads anything). The transformers MoE models route with sort, histc and grouped
# matmuls, which need no host sync, so they are captured.
UNCAPTURABLE = {
    "switch-transformers-labels",
    "switch-transformers experts",
    "bart-labels",
}


@pytest.mark.parametrize("case", CASES)
def test_zoo_model_under_simulated_graph_capture(case: Case) -> None:
    if case.name in UNCAPTURABLE:
        with pytest.raises(CaptureError, match="the host waits for the device"):
            _run(case, capture=True)
        return
    report = _run(case, capture=True)
    assert report.captured and report.ok, str(report)
