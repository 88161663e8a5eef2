"""The planner: pure functions from a model (and one observed forward) to a ``Plan``."""
