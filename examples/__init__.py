"""Runnable examples; each file also exposes build_model() and example_input()."""
