"""Prefill/decode disaggregation: a prefill worker computes a prompt and its first token, its KV moves
to a decode worker (`transfer.py`), which continues the request (docs/architecture.md)."""
