"""Triton kernels (imported only when a backend chooses them): paged attention, fused MoE, block-scaled FP8 GEMM and fused MoE, routers."""
