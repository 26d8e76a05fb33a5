"""Triton kernels (imported only when a backend chooses them): paged attention, fused MoE (also with
block-scaled FP8 experts), the block-scaled FP8 GEMM, routers."""
