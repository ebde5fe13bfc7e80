"""Structured output: grammars compiled from a request's `regex`, `json_schema`, `ebnf` or
`structural_tag` (backend.py) and the per-step token masks of the constrained rows (masks.py).
xgrammar is imported only when the first constrained request arrives."""
