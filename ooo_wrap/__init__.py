"""ooo_wrap: out-of-order backprop for any PyTorch model in one line.

>>> model = ooo_wrap.OOOModule(model, streams=4)
"""

import logging

from ._errors import OOOConfigError, OOOError
from ._events import EventKind, OOOEvent
from ._integrations.config import from_config
from ._integrations.graphed_callables import make_graphed_callables
from ._integrations.graphs import GraphedStep, graphed_step
from ._plan import Plan, Stage
from ._planner.api import plan
from ._planner.cost import H200, ReferenceGPU
from ._runtime.bypass import disabled
from ._runtime.wgrad_layers import register_split_layer
from ._stats import OOOStats
from ._wrapper.module import OOOModule, unwrap
from ._wrapper.registry import events_for
from ._wrapper.tuning import Tuning

__all__ = [
    "H200",
    "EventKind",
    "GraphedStep",
    "OOOConfigError",
    "OOOError",
    "OOOEvent",
    "OOOModule",
    "OOOStats",
    "Plan",
    "ReferenceGPU",
    "Stage",
    "Tuning",
    "disabled",
    "events_for",
    "from_config",
    "graphed_step",
    "make_graphed_callables",
    "plan",
    "register_split_layer",
    "unwrap",
]

__version__ = "0.1.0"

logging.getLogger("ooo_wrap").addHandler(logging.NullHandler())
