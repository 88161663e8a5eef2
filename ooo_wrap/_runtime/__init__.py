"""The runtime: the hot path of a wrapped model (backend, thread state, scheduler, joins)."""
