"""Lightning (package ``lightning``): where to wrap inside a ``LightningModule``.

The place is ``configure_model``: Lightning calls it under its device context, so the
network is built on the device it trains on, and wraps the module in DDP only after it.
Runs on virtual streams (``SimulatedBackend``), compared bitwise with the plain network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from examples.quickstart import build_model
from ooo_wrap.testing import SimulatedBackend

pytestmark = pytest.mark.integrations
L = pytest.importorskip(
    "lightning", reason="needs the integrations extra: pip install -e '.[integrations]'"
)

STEPS = 3


class Net(L.LightningModule):  # type: ignore[misc]
    """Builds (and, with ``wrap``, wraps) the example towers in ``configure_model``."""

    def __init__(self, wrap: bool = True, idempotent: bool = True, simulated: bool = True) -> None:
        super().__init__()
        self.wrap, self.idempotent, self.simulated = wrap, idempotent, simulated
        self.net: nn.Module | None = None
        self.losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if self.idempotent and self.net is not None:  # called again by validate/test
            return
        net = self.net if self.net is not None else build_model()
        if self.wrap:
            backend = SimulatedBackend() if self.simulated else None
            net = ooo_wrap.OOOModule(net, streams=4, backend=backend, planner="static")
        self.net = net

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        assert self.net is not None
        loss = self.net(batch).square().mean()
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch: torch.Tensor, index: int) -> None:
        assert self.net is not None
        self.log("val", self.net(batch).square().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> Any:
    inputs = torch.randn(4 * STEPS, 64, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(inputs, batch_size=4)


def trainer(**options: Any) -> Any:
    # No validation loader: the "no val_dataloader" warning is Lightning's, not ours.
    options.setdefault("accelerator", "cpu")
    return L.Trainer(
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


@pytest.fixture(scope="module")
def plain_run() -> Net:
    plain = Net(wrap=False)
    trainer().fit(plain, data())
    return plain


def assert_same_losses(a: Net, b: Net) -> None:
    assert len(a.losses) == len(b.losses) == STEPS
    assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True))


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_wrapping_in_configure_model_trains_like_the_plain_model(
    tmp_path: Path, plain_run: Net
) -> None:
    model = Net()
    run = trainer()
    run.fit(model, data())
    assert isinstance(model.net, ooo_wrap.OOOModule)
    assert_same_losses(model, plain_run)
    assert_same_state(model, plain_run)
    assert model.net.stats.forwards == STEPS
    assert [event.reason for event in model.net.events] == ["simulated"]

    # The checkpoint has the plain keys: it loads into the plain network and, through
    # load_from_checkpoint (which calls configure_model), into a plain LightningModule.
    run.save_checkpoint(tmp_path / "last.ckpt")
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]
    plain_net = build_model()
    plain_net.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    assert_same_state(plain_net, plain_run.net)  # type: ignore[arg-type]
    loaded = Net.load_from_checkpoint(tmp_path / "last.ckpt", wrap=False)
    assert not isinstance(loaded.net, ooo_wrap.OOOModule)
    assert_same_state(loaded, plain_run)

    # validate() calls configure_model again: the guard keeps the wrapped network.
    wrapped = model.net
    run.validate(model, data(), verbose=False)
    assert model.net is wrapped and wrapped.stats.forwards == 2 * STEPS


def test_configure_model_that_wraps_again_raises_a_clear_error(plain_run: Net) -> None:
    # Without the guard, validate() after fit() would wrap the wrapped network again.
    model = Net(idempotent=False)
    run = trainer()
    run.fit(model, data())
    with pytest.raises(ooo_wrap.OOOConfigError, match="already wrapped"):
        run.validate(model, data(), verbose=False)


def test_wrapping_in_init_works_on_the_cpu(plain_run: Net) -> None:
    # On the CPU, Lightning's move to the device changes nothing, so wrapping in __init__
    # trains the same. On a GPU the model would still be on the CPU there, and the wrap
    # would fall back (reason "cpu"): configure_model is the place.
    model = Net(wrap=False)
    model.net = ooo_wrap.OOOModule(
        build_model(), streams=4, backend=SimulatedBackend(), planner="static"
    )
    trainer().fit(model, data())
    assert_same_losses(model, plain_run)


def test_wrapping_the_whole_lightning_module_works(plain_run: Net) -> None:
    # The LightningModule itself as the wrapped root: the automatic stages descend through
    # its one child, net, to the towers. training_step calls self.net, not the root, so
    # only the per-stage joins run (each stage call is joined when it returns).
    model = Net(wrap=False)
    model.configure_model()
    wrapped = ooo_wrap.OOOModule(model, streams=4, backend=SimulatedBackend(), planner="static")
    assert [stage.name for stage in wrapped.plan.stages] == [f"net.towers.{i}" for i in range(4)]
    trainer().fit(wrapped, data())
    assert wrapped.stats.stage_calls == 4 * STEPS
    assert_same_losses(model, plain_run)


@pytest.mark.cuda
def test_configure_model_builds_and_wraps_on_the_gpu() -> None:
    # Lightning calls configure_model under the GPU as default device: real side streams.
    model = Net(simulated=False)
    trainer(accelerator="gpu", devices=1).fit(model, data())
    assert isinstance(model.net, ooo_wrap.OOOModule)
    assert [(e.kind, e.reason) for e in model.net.events][:1] == [
        (ooo_wrap.EventKind.ENABLED, "accelerator")
    ]
    assert model.net.stats.stage_calls == 4 * STEPS


@pytest.mark.cuda
def test_wrapping_in_init_on_a_gpu_machine_falls_back_and_says_why() -> None:
    # The mistake configure_model avoids: the network is on the CPU when wrapped, so the
    # wrapper leaves it untouched, and Lightning then moves the plain network to the GPU.
    model = Net(wrap=False)
    model.net = ooo_wrap.OOOModule(build_model(), streams=4, planner="static")
    assert not isinstance(model.net, ooo_wrap.OOOModule)
    trainer(accelerator="gpu", devices=1).fit(model, data())
    assert next(model.net.parameters()).is_cuda
    assert [event.reason for event in ooo_wrap.events_for(model.net)] == ["cpu"]
