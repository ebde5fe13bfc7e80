"""A calibration for a GPU that was never profiled here, derived from a measured one by datasheet ratios.

    python -m bench.sim.derive --from h200 --to h100 --out bench/sim/calibration/h100.json

The H100 SXM and the H200 are the same GH100 chip (132 SMs, the same clocks and bf16 tensor-core peak,
PCIe Gen5 to the host); what differs is the memory: HBM3 at 3.35 TB/s and 80 GB against HBM3e at 4.8 TB/s
and 141 GB. So the derived file keeps every fitted rate of the measured GPU and scales:

- the memory-bound read rates (dense weights, KV, the MoE experts in decode and prefill) by the ratio of
  the datasheets' HBM bandwidths: the measured GPU's achieved share of its peak is assumed to carry over;
- the compute rates (decode and prefill GEMMs, attention, the MoE grouped GEMMs) by the ratio of their
  bf16 dense peaks (1.0 between these two);
- nothing else: the per-row, per-step and per-expert fixed costs (launches, small kernels), the host loop,
  the host link (refused when the datasheets name different links), the remote-attention exchange and the
  executor host's relative slowdown are taken as they were measured.

Every figure priced on a derived file is an extrapolation; the file says so (`derived`), and
`python -m bench.sim.replay_sweeps --panels h100` scores it against the runs made on that GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from bench.sim.cost import CALIBRATION_DIR


@dataclass(frozen=True)
class Datasheet:
    """The vendor's figures a derivation scales by (SXM parts)."""

    name: str  # as nvidia-smi names it
    hbm_TBps: float
    bf16_dense_TFLOPs: float
    sms: int
    host_link: str
    memory_mib: int  # nvidia-smi's memory.total


DATASHEETS: Final = {
    "h200": Datasheet("NVIDIA H200", 4.8, 989.0, 132, "PCIe Gen5 x16", 143_771),
    "h100": Datasheet("NVIDIA H100 80GB HBM3", 3.35, 989.0, 132, "PCIe Gen5 x16", 81_559),
}

# (section, key) of every rate a derivation scales; everything else is copied as measured
MEMORY_RATES: Final = (("decode", "weights_GBps"), ("decode", "kv_GBps"), ("moe", "expert_GBps"),
                       ("moe_prefill", "expert_GBps"))
COMPUTE_RATES: Final = (("decode", "gemm_TFLOPs"), ("prefill", "gemm_TFLOPs"), ("prefill", "attention_TFLOPs"),
                        ("moe_prefill", "gemm_TFLOPs"))


def derive(measured: dict[str, Any], src: str, dst: str, source_path: str, command: str) -> dict[str, Any]:
    """The measured calibration `measured` (of GPU type `src`) as a derived one for `dst`."""
    a, b = DATASHEETS[src], DATASHEETS[dst]
    if a.host_link != b.host_link:
        raise ValueError(f"{src} and {dst} reach the host over different links ({a.host_link} vs {b.host_link}): "
                         "a host-link rate cannot be carried over; measure it (bench/kv_rotation.py)")
    if a.sms != b.sms:
        raise ValueError(f"{src} has {a.sms} SMs, {dst} {b.sms}: the fixed per-step costs would not carry over")
    mem, comp = b.hbm_TBps / a.hbm_TBps, b.bf16_dense_TFLOPs / a.bf16_dense_TFLOPs
    out = json.loads(json.dumps(measured))
    for scale, keys in ((mem, MEMORY_RATES), (comp, COMPUTE_RATES)):
        for section, key in keys:
            sec = out.get(section)
            if isinstance(sec, dict) and sec.get(key) is not None:
                sec[key] = float(sec[key]) * scale
    read = out["decode"].pop("hbm_read_GBps_measured", None)  # measured on the source only: not this GPU's
    if read is not None:
        out["decode"]["hbm_read_GBps_derived"] = float(read) * mem
    out["gpu"] = b.name
    out["derived"] = {
        "from": source_path, "from_gpu": a.name, "from_fitted_at": measured.get("fitted_at"),
        "from_git_commit": measured.get("git_commit"),
        "datasheets": {src: asdict(a), dst: asdict(b)},
        "scales": {"memory_rates": mem, "compute_rates": comp},
        "scaled": {"memory": [".".join(k) for k in MEMORY_RATES], "compute": [".".join(k) for k in COMPUTE_RATES]},
        "rule": "fitted rates of the measured GPU; memory-bound read rates x the HBM bandwidth ratio, compute "
                "rates x the bf16 dense peak ratio (datasheets); fixed costs, host loop, host link, exchange "
                "and executor-host slowdown as measured on the source GPU",
        "note": f"NOT profiled on {b.name}: an extrapolation from {a.name}'s runs",
    }
    out["derived_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out["command"] = command
    out.setdefault("missing", {})["derived"] = (
        f"every rate of this file was measured on {a.name} and scaled by datasheet ratios (bench/sim/derive.py)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="src", default="h200", choices=sorted(DATASHEETS),
                   help="the measured GPU type (its calibration file is read)")
    p.add_argument("--to", dest="dst", required=True, choices=sorted(DATASHEETS), help="the GPU type to derive")
    p.add_argument("--calibration", type=Path, default=None,
                   help="the measured calibration (default: bench/sim/calibration/<from>.json)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    if a.src == a.dst:
        p.error("--from and --to name the same GPU")
    path = a.calibration or CALIBRATION_DIR / f"{a.src}.json"
    measured = json.loads(path.read_text())
    if "derived" in measured:
        p.error(f"{path} is itself derived: derive from a measured calibration")
    shown = path.resolve()
    with contextlib.suppress(ValueError):  # outside the working directory: the absolute path
        shown = shown.relative_to(Path.cwd().resolve())
    cmd = f"python -m bench.sim.derive --from {a.src} --to {a.dst} --out {a.out}"
    try:
        out = derive(measured, a.src, a.dst, str(shown), cmd)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    s = out["derived"]["scales"]
    print(f"wrote {a.out}: {out['gpu']} from {out['derived']['from_gpu']} "
          f"(memory rates x {s['memory_rates']:.3f}, compute x {s['compute_rates']:.3f}); SIMULATED, not profiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
