"""The sections of `scripts/gpu_check.py`, the prepared run on a lent GPU: one module per check."""
