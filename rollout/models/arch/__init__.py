"""Architectures: one file each, mapping an HF config.json to a ModelSpec (registry.py lists them)."""
