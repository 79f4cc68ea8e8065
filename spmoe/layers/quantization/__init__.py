"""Quantisation formats shared by the layers: FP8 e4m3 (`fp8`: groups, vectors, the Hadamard
rotation), and FP8 block-scaled linears (`fp8_linear` the math, `fp8_kernels` the
Triton kernels)."""
