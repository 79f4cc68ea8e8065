"""Quantised weights: FP8 block-scaled linears (`fp8_linear` the math, `fp8_kernels` the Triton kernels)."""
