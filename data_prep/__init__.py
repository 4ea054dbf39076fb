"""Offline, resumable, sharded tokenization into Megatron-Core indexed datasets (see docs/data_prep.md)."""

__version__ = "0.1.0"
"""Tool version written into every manifest."""
