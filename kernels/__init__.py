"""Triton GPU kernels, each with the torch reference it is tested against."""
