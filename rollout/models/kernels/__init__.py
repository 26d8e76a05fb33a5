"""Triton kernels (imported only when a backend chooses them): paged attention, fused MoE, routers."""
