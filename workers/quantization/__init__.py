"""Quantized linear weights: GGUF blocks (CPU kernels), AWQ/GPTQ int4 and FP8 (Triton on CUDA).

Every format is a `QuantizedWeight` (`base.py`) that stands in for a linear layer's dense `[out, in]` parameter and
does its own matmul; `packed_linear.linear` dispatches to it, so the model code is the same for every format.
"""
