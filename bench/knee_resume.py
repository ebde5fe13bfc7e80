"""``bench/goodput_knee.py --resume PREV_DIR``: a knee search continued over several device calls.

One device call is capped at 600 s, so a panel of 150 requests a point x 3 repeats often needs two or
three calls. A resumed call reads the previous call's folder (its knee.json and serving reports), refuses
when it would measure differently (`measurement`: anything a point's result depends on), takes the points
measured there as measured, and continues the search from where it stopped (knee.json's ``resume_at``).

One folder, not several: the resumed call's folder holds every earlier call's reports (copied, so
bench/goodput.py reads the whole panel from it alone) and knee.json's ``calls`` record every call, so the
next call resumes from the latest folder only, and nothing can be merged twice or left out.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import goodput as G

# Knee.json's "setting" keys a point's result depends on (the search plan, the server's flags, the
# workload); the budget, passes, port, paths and call id do not. The plan's derived stride and offsets
# (which trace rows each repeat replays) are compared too.
SETTING_KEYS = ("runs", "repeats", "min_req", "seconds", "target", "extend", "model", "device", "dtype",
                "share", "host_gb", "server_arg", "variant", "trace", "arrival", "ttft", "tpot", "max_in", "max_out",
                "vocab_size")
# serving.py's config keys each earlier report must share with what this call would run at that point.
REPORT_KEYS = ("trace", "num_requests", "trace_offset", "seed", "arrival", "request_rate", "max_input_len",
               "max_output_len", "ttft_slo", "tbt_slo", "tbt_stat", "vocab_size")


class ResumeError(ValueError):
    """The previous folder cannot be continued by this call; the message names the field or file."""


def measurement(setting: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The fields two calls of one search must share, from knee.json's "setting" and "plan"."""
    doc = {k: setting.get(k) for k in SETTING_KEYS}
    doc["variant"] = doc["variant"] or []  # a knee.json from before --variant: none
    doc.update(grid=plan.get("rates"), stride=plan.get("stride"), offsets=plan.get("offsets"))
    return json.loads(json.dumps(doc, default=str))  # tuples as lists, Paths as text: as knee.json has them


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, bool) or isinstance(y, bool):
        return x is y
    if isinstance(x, int | float) and isinstance(y, int | float):
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    return bool(x == y)


def _flag(key: str) -> str:
    return {"grid": "--grid (its rates)", "stride": "the trace stride (from --grid, --seconds, --min-req, --extend)",
            "offsets": "the trace offsets (from --repeats and the stride)"}.get(key, "--" + key.replace("_", "-"))


def check_same(mine: dict[str, Any], theirs: dict[str, Any], where: str) -> None:
    for key, value in mine.items():
        if not _same(value, theirs.get(key)):
            raise ResumeError(f"--resume {where}: the plan differs in {key} ({_flag(key)}): this call "
                              f"{value!r}, the previous call {theirs.get(key)!r}; a resumed call must measure "
                              "the same way (same flags)")


@dataclass
class Previous:
    """What a resumed call takes over from the previous call's folder."""

    folder: Path
    call_id: str
    curves: dict[str, dict[float, float]]  # run -> rate -> mean attainment (from the reports)
    orders: dict[str, list[dict[str, Any]]]  # run -> its points in the order measured, each with its call
    resume_at: dict[str, Any]  # knee.json's Cursor: pass_no, todo, index
    estimator: dict[str, float]
    calls: list[dict[str, Any]]  # every call merged so far, oldest first
    reports: list[Path] = field(default_factory=list)  # the reports (and logs) of the points measured

    def points(self) -> set[tuple[str, float]]:
        return {(run, rate) for run, curve in self.curves.items() for rate in curve}


def _smi(device: str, field: str) -> str | None:
    """nvidia-smi's `field` for the card torch calls `device`, None where it cannot be told."""
    ordinal = int(device.partition(":")[2] or 0)  # torch's index among the visible cards
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = visible[ordinal] if ordinal < len(visible) and visible[ordinal].isdigit() else str(ordinal)
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader", "-i", index],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0].strip() if out.strip() else None


def gpu_name(device: str) -> str | None:
    """The card this call's servers run on, as nvidia-smi names it ("NVIDIA H200"), "cpu" for a CPU run,
    None where it cannot be told. A panel never merges cards: another card is another decode speed."""
    return _smi(device, "name") if device.startswith("cuda") else device


def gpu_uuid(device: str) -> str | None:
    """The physical card ("GPU-8f2c..."), None on CPU or where it cannot be told. Calls that cannot share
    one call (a point pair longer than a call) are the nearest thing when they ran on one card at one
    commit; this is what shows they did."""
    return _smi(device, "uuid") if device.startswith("cuda") else None


def check_gpu(calls: list[dict[str, Any]], gpu: str | None, where: str) -> list[str]:
    """Refuse a resume on another card than the earlier calls'; the warnings for calls that did not record one."""
    for c in calls:
        theirs = c.get("gpu")
        if gpu is not None and theirs is not None and theirs != gpu:
            raise ResumeError(f"--resume {where}: call {c.get('call_id')} ran on {theirs}, this call runs on {gpu}; "
                              "a panel never merges cards (start a new panel)")
    unknown = [str(c.get("call_id")) for c in calls if c.get("gpu") is None]
    return [f"GPU NOT RECORDED for earlier calls {', '.join(unknown)} (before 2026-12-06): "
            f"check that they ran on {gpu or 'the same card'}"] if unknown else []


def _legacy_call(doc: dict[str, Any], dates: list[str]) -> dict[str, Any]:
    """The call record of a knee.json written before --resume existed: its head, its points."""
    return {"call_id": doc.get("call_id"), "git_commit": doc.get("git_commit"), "git_dirty": doc.get("git_dirty"),
            "commit_source": doc.get("commit_source"), "date": doc.get("date") or (min(dates) if dates else None),
            "gpu": doc.get("gpu"), "gpu_uuid": doc.get("gpu_uuid"),
            "stopped": doc.get("stopped"), "elapsed_s": doc.get("elapsed_s"), "budget_s": doc.get("budget_s"),
            "points": {run: [e["rate"] for e in r.get("order", [])] for run, r in doc.get("runs", {}).items()}}


def load(folder: Path, mine: dict[str, Any], repeats: int, name: Callable[[str, float, int], str],
         config: Callable[[str, float, int], dict[str, Any]]) -> Previous:
    """Read and check the previous call's folder. `mine`: this call's `measurement`; `name(run, rate, k)`
    the report file of a repeat; `config(run, rate, k)` serving.py's config this call would run there."""
    path = folder / "knee.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ResumeError(f"--resume {folder}: cannot read knee.json ({e})") from e
    check_same(mine, measurement(doc.get("setting", {}), doc.get("plan", {})), str(folder))
    call_id = str(doc.get("call_id"))
    curves: dict[str, dict[float, float]] = {}
    orders: dict[str, list[dict[str, Any]]] = {}
    reports: list[Path] = []
    dates: list[str] = []
    for run, r in doc.get("runs", {}).items():
        order = [{**e, "call": e.get("call", call_id)} for e in r.get("order", [])]
        rates = [float(e["rate"]) for e in order]
        if sorted(f"{x:g}" for x in rates) != sorted(r.get("curve", {})):
            raise ResumeError(f"--resume {folder}: knee.json's {run} order {rates} and curve "
                              f"{list(r.get('curve', {}))} "
                              "disagree")
        curve = {}
        for rate in rates:
            scores = []
            for k in range(repeats):
                rp = folder / name(run, rate, k)
                try:
                    report = json.loads(rp.read_text())
                except (OSError, ValueError) as e:
                    raise ResumeError(f"--resume {folder}: the report {rp.name} of a measured point cannot be read "
                                      f"({e}); carry the whole folder") from e
                want, have = config(run, rate, k), report.get("config", {})
                for key in REPORT_KEYS:
                    if not _same(want.get(key), have.get(key)):
                        raise ResumeError(f"--resume {folder}: {rp.name} ran with config.{key} {have.get(key)!r}, "
                                          f"this call would run {want.get(key)!r}")
                scores.append(G.point_from_report(run, rate, report, repeat=k).attainment)
                dates.append(str(report.get("date") or ""))
                reports += [rp, *[p for p in [rp.with_suffix(".log")] if p.exists()]]
            curve[rate] = sum(scores) / len(scores)
            if not math.isclose(curve[rate], float(r["curve"][f"{rate:g}"]), abs_tol=1e-9):
                raise ResumeError(f"--resume {folder}: {run} at {rate:g}: knee.json's attainment "
                                  f"{r['curve'][f'{rate:g}']} is not its reports' mean {curve[rate]}")
        curves[run], orders[run] = curve, order
    calls = doc.get("calls") or [_legacy_call(doc, [d for d in dates if d])]
    return Previous(folder, call_id, curves, orders, doc.get("resume_at") or {"pass_no": 0, "todo": None, "index": 0},
                    doc.get("estimator") or {}, calls, reports)


def check_out(folder: Path, out: Path) -> None:
    """The resumed call's folder must be a fresh one beside the previous (copies go in, nothing is mixed)."""
    a, b = folder.resolve(), out.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise ResumeError(f"--out {out} and --resume {folder} must be separate folders")
    if out.exists() and (any(out.glob("gp_*.json")) or (out / "knee.json").exists()):
        raise ResumeError(f"--out {out} already holds a knee search's reports; give a fresh folder")


def carry_over(prev: Previous, out: Path) -> None:
    """Copy the measured points' reports (and logs) to `out`, where bench/goodput.py reads them; every other
    file of the previous folder (server logs, metrics, its knee.json and table) to calls/<its call id>/;
    the earlier calls' folders it held under calls/ to calls/ as they were."""
    out.mkdir(parents=True, exist_ok=True)
    for rp in prev.reports:
        shutil.copy2(rp, out / rp.name)
    taken = {rp.name for rp in prev.reports}
    archive = out / "calls" / re.sub(r"[^A-Za-z0-9._-]", "_", prev.call_id)
    archive.mkdir(parents=True, exist_ok=True)
    for entry in prev.folder.iterdir():
        if entry.name == "calls" and entry.is_dir():
            shutil.copytree(entry, out / "calls", dirs_exist_ok=True)
        elif entry.name not in taken:
            if entry.is_dir():
                shutil.copytree(entry, archive / entry.name, dirs_exist_ok=True)
            else:
                shutil.copy2(entry, archive / entry.name)


def merged(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The calls a panel merges, and the warnings a reader must see (commits that differ, dirty trees)."""
    commits = {str(c.get("git_commit")) for c in calls}
    warnings = [f"PANEL MERGES {len(calls)} CALLS: " + ", ".join(str(c["call_id"]) for c in calls)]
    if len(commits) > 1:
        warnings.append("CALLS RAN DIFFERENT COMMITS: " + ", ".join(
            f"{str(c.get('git_commit'))[:12]} ({c['call_id']})" for c in calls))
    dirty = [str(c["call_id"]) for c in calls if c.get("git_dirty") is not False]
    if dirty:
        warnings.append("DIRTY OR UNKNOWN TREE in calls: " + ", ".join(dirty))
    gpus = {c.get("gpu") for c in calls} - {None}
    if len(gpus) > 1:  # check_gpu refuses this; a hand-edited or older folder could still hold it
        warnings.append("CALLS RAN ON DIFFERENT GPUS: " + ", ".join(f"{c.get('gpu')} ({c['call_id']})" for c in calls))
    cards = {c.get("gpu_uuid") for c in calls}
    if None not in cards and len(cards) > 1:
        warnings.append(f"CALLS RAN ON {len(cards)} PHYSICAL CARDS: " + ", ".join(
            f"{str(c.get('gpu_uuid'))[:12]} ({c['call_id']})" for c in calls))
    one_card = None not in cards and len(cards) == 1
    return {"merged_calls": len(calls), "commits_differ": len(commits) > 1, "calls": calls, "warnings": warnings,
            "one_card_one_commit": one_card and len(commits) == 1 and not dirty}


def calls_text(doc: dict[str, Any]) -> str:
    """goodput.txt's lines on the calls a resumed panel merges."""
    lines = [f"panel merges {doc['merged_calls']} calls (bench/goodput_knee.py --resume; their reports are here, "
             "their other files under calls/):"]
    for c in doc["calls"]:
        dirty = {True: "dirty", False: "clean"}.get(c.get("git_dirty"), "dirty unknown")
        pts = "; ".join(f"{run} {' '.join(f'{r:g}' for r in rates)}" for run, rates in c["points"].items() if rates)
        card = f" {str(c['gpu_uuid'])[:12]}" if c.get("gpu_uuid") else ""
        lines.append(f"  {c['call_id']}  commit {str(c.get('git_commit'))[:12]} ({dirty})  {c.get('date')}  "
                     f"{c.get('gpu') or 'GPU not recorded'}{card}  points: {pts or 'none'}")
    if doc.get("one_card_one_commit") and doc["merged_calls"] > 1:
        lines.append("  every call on one physical card at one clean commit: consecutive calls, not one call")
    lines.extend(f"!!! {w}" for w in doc["warnings"])
    return "\n".join(lines)
