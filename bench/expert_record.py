"""Record an MoE server's expert distribution under a serving workload, and read its skew.

    python bench/expert_record.py --out DIR -- --base-url http://127.0.0.1:30000 --trace mooncake \\
        --num-requests 150 --request-rate 2 --max-input-len 7680 --max-output-len 256

Against a server started with `--expert-distribution-recorder-mode stat`: POST
/start_expert_distribution_record, run bench/serving.py with the arguments after `--` (its report goes to
DIR/serving.json), POST /stop_... and /dump_... (the dump files go to DIR), then print and write
(DIR/skew.json) what the record says for the simulator: per layer, the share of one token's picks the most
used experts take, and the experts a decode step of r rows reads under this skew against uniform routing's
(bench/sim/expert_load.py, `skewed_experts_hit`). The server must run on this machine for the dump to land
in DIR (a worker writes its own files).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench import serving
from bench.sim.expert_load import pick_probabilities, read_record
from bench.sim.geometry import expected_experts_hit, skewed_experts_hit

ROWS = (1, 4, 8, 16, 32, 64)


def skew(doc: dict[str, Any], rows: Sequence[int] = ROWS) -> dict[str, Any]:
    """What a record says for pricing: experts hit at `rows` under the record and under uniform routing,
    and how concentrated each layer's picks are (the share of the top k experts, the top 1/8 of experts)."""
    picks = pick_probabilities(doc)
    k, e = int(doc["top_k"]), len(picks[0])
    top = max(1, e // 8)
    shares = [sorted(q, reverse=True) for q in picks]
    return {
        "layers": len(picks), "num_experts": e, "top_k": k, "tokens": float(sum(doc["logical_count"][0]) / k),
        "top_k_share": [sum(s[:k]) / k for s in shares],  # of one token's k picks, those of the k most used
        "top_eighth_share": [sum(s[:top]) / k for s in shares],
        "experts_hit": {str(r): {"recorded": sum(skewed_experts_hit(q, r) for q in picks) / len(picks),
                                 "uniform": expected_experts_hit(e, k, r)} for r in rows},
    }


def _post(client: httpx.Client, what: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(f"/{what}_expert_distribution_record", json=body)
    if r.status_code != 200:
        raise SystemExit(f"{what}_expert_distribution_record: HTTP {r.status_code}: {r.text[:300]}")
    out: dict[str, Any] = r.json()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after `--` are bench/serving.py's (--base-url, the workload).")
    p.add_argument("--out", type=Path, required=True, help="folder for the dump, serving.json and skew.json")
    p.add_argument("--model", default=None, help="the served model to record (default: the default model)")
    a = p.parse_args(argv[:cut])
    sargs = serving.build_parser().parse_args([*argv[cut + 1:], "--output-json", str(a.out / "serving.json")])
    serving.validate(sargs)
    a.out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {sargs.api_key}"} if sargs.api_key else {}
    body = {"model": a.model, "output_dir": str(a.out.resolve())}
    with httpx.Client(base_url=sargs.base_url, headers=headers, timeout=120.0) as client:
        _post(client, "start", body)
        asyncio.run(serving.run(sargs))
        _post(client, "stop", body)
        files = [f for f in _post(client, "dump", body).get("files", []) if str(f).endswith(".json")]
    if not files:
        raise SystemExit("the dump wrote no .json file")
    summary = {"files": files, "per_worker": [skew(read_record(f)) for f in files]}
    (a.out / "skew.json").write_text(json.dumps(summary, indent=1))
    for f, s in zip(files, summary["per_worker"], strict=True):
        print(f"{f}: {s['layers']} layers x {s['num_experts']} experts, top {s['top_k']}, {s['tokens']:.0f} tokens")
        mean = sum(s["top_k_share"]) / len(s["top_k_share"])
        print(f"  the k most used experts take {100 * mean:.1f} % of the picks (layer mean; uniform: "
              f"{100 * s['top_k'] / s['num_experts']:.1f} %)")
        for r, h in s["experts_hit"].items():
            print(f"  rows {r:>3}: {h['recorded']:6.1f} experts hit a layer under this record, "
                  f"{h['uniform']:6.1f} uniform")
    return 0


if __name__ == "__main__":
    sys.exit(main())
