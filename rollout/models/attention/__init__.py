"""Attention: the paged core, its backends (torch, Triton, FlashInfer), GQA and MLA projections."""
