"""The MoE layer: routing rules (the capture hook), routers, fused experts over their
implementations, the layer block and the expert-parallel group."""
