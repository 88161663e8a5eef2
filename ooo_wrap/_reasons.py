"""Why a wrapped model runs plain or a stage call runs inline: one enum, one message table.

The reasons of ``DISABLED`` events (the wrapper left the model untouched, or removed every
hook) and of ``BYPASSED`` events (stage calls ran inline on the caller's stream). A
``Reason`` is a ``str``, so ``event.reason == "cpu"`` holds and it prints as its value.
"""

from __future__ import annotations

from ._events import ValueEnum

__all__ = ["Reason"]


class Reason(str, ValueEnum):  # prints as its value, as a plain str would
    """The machine-readable reason of a ``DISABLED`` or ``BYPASSED`` event."""

    # DISABLED: the model is left untouched, or runs with no hook at all.
    CPU = "cpu"
    MPS = "mps"
    NO_ACCELERATOR = "no_accelerator"
    TOO_FEW_STAGES = "too_few_stages"
    MULTI_DEVICE = "multi_device"
    COMPILED = "compiled"
    UNSUPPORTED_MODULE = "unsupported_module"
    UNSUPPORTED_TORCH = "unsupported_torch"
    NO_PARALLELISM = "no_parallelism"
    MEASURED_SLOWER = "measured_slower"
    SETUP_FAILED = "setup_failed"
    PINNED = "pinned"
    # BYPASSED: stage calls run inline on the caller's stream.
    COMPILING = "compiling"
    TRACING = "tracing"
    DISABLED = "disabled"
    TUNING = "tuning"
    NO_GRAD = "no_grad"

    @property
    def message(self) -> str:
        """The usual message of an event with this reason.

        ``no_parallelism``, ``measured_slower``, ``setup_failed`` and ``pinned`` have none
        of their own: their events say what was found, measured, raised or pinned.
        """
        return MESSAGES[self]


# Keyed by Reason; a Reason is a str, so a plain reason string finds its message too.
MESSAGES: dict[str, str] = {
    Reason.CPU: "model is on the CPU: standard backward (side streams need an accelerator; "
    "move the model to it before wrapping)",
    Reason.MPS: "model is on MPS, which has a single stream: standard backward",
    Reason.NO_ACCELERATOR: "no stream-capable accelerator for the model's device: standard "
    "backward",
    Reason.TOO_FEW_STAGES: "fewer than two stages: nothing to overlap, standard backward (name "
    "stages with stages=[...] or a model.ooo_stage_names attribute)",
    Reason.MULTI_DEVICE: "stages span several devices: standard backward (wrap a model that "
    "lives on one device)",
    Reason.COMPILED: "the model is torch.compile'd: out-of-order backprop is off, the compiled "
    "path wins (they are mutually exclusive; pick one and benchmark it)",
    Reason.UNSUPPORTED_MODULE: "TorchScript modules cannot run Python hooks: standard backward",
    Reason.UNSUPPORTED_TORCH: "this torch lacks a private PyTorch name that running stages on "
    "side streams safely depends on (a warning names it): standard backward",
    Reason.COMPILING: "ran under torch.compile: stages run inline on the caller's stream (the "
    "compiled path wins). Compiled calls are not counted (a count kept inside compiled code "
    "would make it recompile every call), so this event is recorded once and stats leave "
    "them out",
    Reason.TRACING: "running under torch.jit.trace: stages run inline",
    Reason.DISABLED: "inside ooo_wrap.disabled(): stages run inline on the caller's stream",
    Reason.TUNING: "measured tuning runs every other training step as the plain model (stages "
    "inline on the caller's stream) to time it against the plan; model.tuning shows the "
    "measurement",
    Reason.NO_GRAD: "gradients are off (torch.no_grad or torch.inference_mode): there is no "
    "backward to overlap, so stages run inline on the caller's stream",
}
