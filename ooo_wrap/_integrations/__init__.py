"""Integrations: CUDA graph recipes and the trainer-config entry point."""
