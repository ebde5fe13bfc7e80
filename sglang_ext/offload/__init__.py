"""Offload data plane: moving a model's attention work between devices and processes (issue 9)."""
