"""Command-line tools for checking ooo_wrap on a GPU (see gpu_check.sh)."""
