"""Coordinator: the public API; gating, the draft -> verify -> accept loop, streaming."""
