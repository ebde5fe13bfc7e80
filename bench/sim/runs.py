"""The measurements the cost model is fitted to, read from bench/results as each bench script wrote them.

Reports are recognised by their structure, not their names (issue folders hold them under other names):
- bench/offline.py: `decode` rows (bs, ctx, step_ms; an MoE run also `experts_hit`, the measured mean of
  distinct experts per sparse layer) and `prefill` rows (reqs, len, ms), `env.gpu/model` (a preset name,
  `preset:mixtral-8x7b`, whose geometry `report_geometry` checks against the run's `env.weight_GB`);
- bench/remote_step.py: `rows` (bs, ctx, share, remote_rows, graph_ms); share 0 is an all-local decode step;
- bench/remote_host.py: `host_alone_ms` and `rows` with `increase`;
- bench/kv_rotation.py: `summary.peak_gbps` and `summary.methods`;
- bench/remote_attention.py exchange: `summary` rows with `gpu_signalled_graph` per topology and bs.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.sim.geometry import Geometry

if TYPE_CHECKING:
    from bench.sim.cost import CostModel

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


@dataclass(frozen=True)
class Report:
    kind: str  # offline | remote_step | remote_host | kv_rotation | ra_exchange
    path: Path
    data: dict[str, Any]

    @property
    def env(self) -> dict[str, Any]:
        env = self.data.get("env")
        return env if isinstance(env, dict) else {}

    @property
    def date(self) -> str:
        return str(self.env.get("date", ""))

    @property
    def gpu(self) -> str:
        gpus = self.env.get("gpus")
        return str(self.env.get("gpu") or (gpus[0] if gpus else ""))

    @property
    def model(self) -> str:
        return str(self.env.get("model", "")).removeprefix("preset:")

    def rel(self) -> str:
        try:
            return str(self.path.resolve().relative_to(REPO))
        except ValueError:
            return str(self.path)


def classify(d: Any) -> str | None:
    if not isinstance(d, dict):
        return None
    dec = d.get("decode")
    if isinstance(dec, list) and any(isinstance(r, dict) and "step_ms" in r for r in dec):
        return "offline"
    pre = d.get("prefill")  # bench/offline.py --sections prefill (e.g. --prefill-shapes rows only)
    if isinstance(dec, list) and isinstance(pre, list) and any(isinstance(r, dict) and "ms" in r for r in pre):
        return "offline"
    if "host_alone_ms" in d:
        return "remote_host"
    summ = d.get("summary")
    if isinstance(summ, dict) and "peak_gbps" in summ and "methods" in summ:
        return "kv_rotation"
    if isinstance(summ, list) and summ and isinstance(summ[0], dict) and "gpu_signalled_graph" in summ[0]:
        return "ra_exchange"
    rows = d.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict) and {"share", "remote_rows"} <= rows[0].keys():
        return "remote_step"
    return None


def find_reports(root: Path = RESULTS, gpu: str = "H200") -> list[Report]:
    """Every recognised report under `root` whose GPU name contains `gpu`, oldest first."""
    out = []
    for p in sorted(root.rglob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        kind = classify(d)
        if kind is None:
            continue
        r = Report(kind, p, d)
        if gpu.lower() in r.gpu.lower():
            out.append(r)
    return sorted(out, key=lambda r: (r.date, str(r.path)))


def commit_of(path: Path) -> str | None:
    """The commit that added a result file to the repository (None outside git)."""
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "-1", "--", str(path)], cwd=REPO,
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


@dataclass(frozen=True)
class DecodeRow:
    source: str
    model: str
    bs: int
    ctx: int
    ms: float
    what: str  # "offline step_ms" | "remote_step all-local graph_ms" | "remote_host host alone"
    experts_hit: float | None = None  # MoE: distinct experts per sparse layer the run counted, mean over layers


@dataclass(frozen=True)
class PrefillRow:
    source: str
    model: str
    reqs: int
    length: int
    ms: float
    prefix: int = 0  # tokens before each chunk (bench/offline.py's REQSxLEN@PREFIX)
    decode_rows: int = 0  # decode rows riding along, and their context (+ROWSdCTX)
    decode_ctx: int = 0

    @property
    def single(self) -> bool:
        """A lone prompt from position 0: the rows the dense prefill rates are fitted to. Chunks after a prefix,
        batches and mixed forwards only validate how the fitted rates price them (as serving's forwards run)."""
        return self.reqs == 1 and self.prefix == 0 and self.decode_rows == 0

    @property
    def moe_fitted(self) -> bool:
        """An MoE's prefill fit also takes a lone chunk after a prefix: beside a prompt of as many tokens from
        position 0 it tells the attention apart from the expert work (fit.equal_token_pairs). Batches of
        several requests and forwards with decode rows riding stay held out."""
        return self.reqs == 1 and self.decode_rows == 0

    @property
    def shape(self) -> str:
        return (f"{self.reqs} x {self.length}" + (f" @ {self.prefix}" if self.prefix else "")
                + (f" + {self.decode_rows} decoding at {self.decode_ctx}" if self.decode_rows else ""))

    def priced_s(self, cost: CostModel) -> float:
        return cost.prefill_s([(self.length, self.prefix + self.length)] * self.reqs, self.decode_rows,
                              self.decode_rows * self.decode_ctx)


def decode_rows(reports: list[Report]) -> list[DecodeRow]:
    """All-local decode steps: offline step_ms, remote_step share-0 graph_ms (the same forward + argmax
    under graphs: 9.26-9.28 ms at bs 64 / 2K in both), remote_host's host alone."""
    rows: list[DecodeRow] = []
    for r in reports:
        if r.kind == "offline":
            rows += [DecodeRow(r.rel(), r.model, int(d["bs"]), int(d["ctx"]), float(d["step_ms"]), "offline step_ms",
                               float(d["experts_hit"]) if d.get("experts_hit") is not None else None)
                     for d in r.data["decode"] if "step_ms" in d]
        elif r.kind == "remote_step":
            rows += [DecodeRow(r.rel(), r.model, int(d["bs"]), int(d["ctx"]), float(d["graph_ms"]),
                               "remote_step all-local graph_ms")
                     for d in r.data["rows"] if d.get("share") == 0.0 and "graph_ms" in d]
        elif r.kind == "remote_host" and ":" in str(r.env.get("host", "")):
            bs, ctx = (int(x) for x in str(r.env["host"]).split(":"))
            rows.append(DecodeRow(r.rel(), r.model, bs, ctx, float(r.data["host_alone_ms"]), "remote_host host alone"))
    return rows


def report_geometry(report: Report) -> Geometry:
    """The geometry preset a report's `env.model` names, checked against the weight bytes the run itself
    counted (`env.weight_GB`, all experts included): a preset that drifted from the run is an error here,
    not a silent mispricing."""
    geo = Geometry.preset(report.model)
    measured = report.env.get("weight_GB")
    if measured is not None:
        total = geo.dense_weight_bytes + geo.sparse_layers * geo.num_experts * geo.expert_bytes
        if abs(total / (float(measured) * 1e9) - 1.0) > 0.01:
            raise ValueError(f"{report.rel()}: preset {report.model!r} has {total / 1e9:.2f} GB of weights, "
                             f"the run counted {float(measured):.2f} GB")
    return geo


def prefill_rows(reports: list[Report]) -> list[PrefillRow]:
    return [PrefillRow(r.rel(), r.model, int(p["reqs"]), int(p["len"]), float(p["ms"]), int(p.get("prefix", 0)),
                       int(p.get("decode_rows", 0)), int(p.get("decode_ctx", 0)))
            for r in reports if r.kind == "offline" for p in r.data.get("prefill") or []]
