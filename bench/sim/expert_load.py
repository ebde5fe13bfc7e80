"""A trained router's skew, from a server's expert distribution record, for the cost model.

A server started with `--expert-distribution-recorder-mode stat` counts, per MoE layer and expert, the
tokens routed there between `POST /start_expert_distribution_record` and `/stop_expert_distribution_record`;
`/dump_expert_distribution_record` writes them as `expert_distribution_recorder_<worker>_<ms>.json` (and a
`.pt` for SGLang's tools) with `logical_count` [sparse layers][experts] and `top_k` (docs/api.md). Each
expert's count over the tokens counted is the chance one token picks it, which prices a decode step's
experts hit (bench/sim/geometry.py, `skewed_experts_hit`) in place of uniform routing's expectation.

Use a record taken on the model's real weights under the traffic to be priced: a dummy-weight model's
router is not a trained one's (docs/simulator.md, "What it does not model").
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bench.sim.geometry import Geometry


def read_record(path: str | Path) -> dict[str, Any]:
    """The dump's JSON (the `.json` beside a `.pt` is read when given the `.pt`)."""
    p = Path(path)
    if p.suffix == ".pt":
        p = p.with_suffix(".json")
    if not p.is_file():
        raise ValueError(f"expert distribution record {path}: no such file (give the dump's .json)")
    doc = json.loads(p.read_text())
    if not isinstance(doc, dict) or "logical_count" not in doc:
        raise ValueError(f"{p}: not an expert distribution record (no `logical_count`)")
    return doc


def pick_probabilities(doc: dict[str, Any]) -> tuple[tuple[float, ...], ...]:
    """Per sparse layer, each expert's count over the tokens counted (sums to top_k in every layer)."""
    counts = [[float(c) for c in row] for row in doc["logical_count"]]
    top_k = int(doc.get("top_k") or 0)
    if not counts or top_k <= 0:
        raise ValueError("expert distribution record: needs a non-empty `logical_count` and `top_k` >= 1")
    out = []
    for i, row in enumerate(counts):
        picks = sum(row)
        if picks <= 0:
            raise ValueError(f"expert distribution record: layer row {i} counted no token (record while serving)")
        tokens = picks / top_k
        out.append(tuple(c / tokens for c in row))
    return tuple(out)


def with_record(geo: Geometry, path: str | Path) -> Geometry:
    """`geo` priced with the record's routing skew; the record must be of this geometry."""
    doc = read_record(path)
    pick = pick_probabilities(doc)
    if not geo.is_moe:
        raise ValueError(f"{path}: an expert distribution record, but {geo.name or 'the model'} has no MoE layers")
    if len(pick) != geo.sparse_layers or any(len(q) != geo.num_experts for q in pick):
        raise ValueError(f"{path}: {len(pick)} layers x {len(pick[0])} experts recorded, the model has "
                         f"{geo.sparse_layers} x {geo.num_experts}")
    if int(doc["top_k"]) != geo.top_k:
        raise ValueError(f"{path}: recorded top_k {doc['top_k']}, the model's is {geo.top_k}")
    return dataclasses.replace(geo, expert_pick=pick)
