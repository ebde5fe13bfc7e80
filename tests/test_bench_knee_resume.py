"""bench/goodput_knee.py --resume (bench/knee_resume.py): a knee search cut by the budget (or killed) and
resumed over several calls measures the same points, each once, and ends at the same knee as one
uninterrupted call; a call that would measure differently is refused, naming the field; the merged calls
and commits that differ are recorded in knee.json, goodput.txt and goodput.json. No server: an executor
writes serving.py-shaped reports against a fake clock."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import goodput as G
from bench import goodput_knee as K
from bench import serving
from tests.test_bench_goodput_knee import Clock, Fake, knees

RUNS = ["fcfs-recompute", "lvf-rotate"]
KNEES = knees(**{"fcfs-recompute": 5.3, "lvf-rotate": 6.7})
ARGS = ["--runs", *RUNS, "--grid", "2", "4", "6", "8", "--repeats", "3", "--seconds", "30", "--trace", "synthetic",
        "--model", "", "--device", "cpu", "--max-in", "64", "--max-out", "8"]
# what one uninterrupted search measures (tests/test_bench_goodput_knee.py's bisection test)
WHOLE = {"fcfs-recompute": [2, 4, 6, 5, 5.5], "lvf-rotate": [2, 4, 5, 5.5, 6, 8, 7, 6.5]}


class Killed(BaseException):
    """The device call's timeout: not an Exception, so the search does not catch it."""


class Reporting(Fake):
    """Fake's attainment and clock, and a serving.py report per repeat (the config serving.py would record)."""

    def __init__(self, a: argparse.Namespace, plan: K.Plan, clock: Clock, att: Callable[[str, float], float],
                 call_id: str, kill_at: int | None = None) -> None:
        super().__init__(plan, clock, att)
        self.a, self.call_id, self.kill_at = a, call_id, kill_at

    def measure(self, run: str, rate: float) -> float:
        if self.kill_at is not None and len([c for c in self.calls if c[0] == "measure"]) == self.kill_at:
            self._report(run, rate, 0)  # killed after its first repeat: a partial point in the folder
            raise Killed
        super().measure(run, rate)
        scores = [self._report(run, rate, k) for k in range(self.plan.repeats)]
        return sum(scores) / len(scores)  # from the reports, as ServerExecutor's

    def _report(self, run: str, rate: float, k: int) -> float:
        argv = K.serving_argv(self.a, self.plan, run, rate, k, "http://127.0.0.1:1", self.a.out, self.call_id)
        cfg = {key: str(v) if isinstance(v, Path) else v
               for key, v in vars(serving.build_parser().parse_args(argv)).items()}
        n = self.plan.n(rate)
        report = {**serving.provenance(self.call_id), "date": "2026-12-04T00:00:00+00:00", "config": cfg,
                  "workload": {"scheduled": n, "not_sent": 0, "arrival": "poisson"},
                  "metrics": {"sent": n, "request_throughput_rps": rate, "ttft_ms": {"p99": 1.0},
                              "tpot_ms": {"p99": 1.0}, "slo": {"both_attainment": self.att(run, rate)}}}
        (self.a.out / K.report_name(run, "poisson", rate, k)).write_text(json.dumps(report))
        return G.point_from_report(run, rate, report, repeat=k).attainment


def call(out: Path, budget: float, call_id: str, *extra: str, clock: Clock | None = None,
         kill_at: int | None = None) -> tuple[int, Reporting]:
    argv = [*ARGS, "--budget-s", str(budget), "--call-id", call_id, "--out", str(out), *extra]
    a = K.build_parser().parse_args(argv)
    plan = K.Plan(tuple(a.grid), a.repeats, a.seconds, a.min_req, a.target, K.TOLERANCE, a.extend)
    clock = clock or Clock()
    fake = Reporting(a, plan, clock, KNEES, call_id, kill_at)
    a.out.mkdir(parents=True, exist_ok=True)  # the fake writes reports before main would make it
    return K.main(argv, executor=fake, clock=clock), fake


def doc(out: Path, name: str = "knee.json") -> dict[str, Any]:
    return json.loads((out / name).read_text())


def chain(tmp: Path, budget: float, monkeypatch: pytest.MonkeyPatch,
          commit: Callable[[int], str] = lambda i: "a" * 40) -> tuple[list[Path], list[Reporting]]:
    """Calls of `budget` seconds, each resuming the last, until the search settles."""
    outs: list[Path] = []
    fakes: list[Reporting] = []
    for i in range(12):
        monkeypatch.setenv(serving.COMMIT_ENV, commit(i))
        monkeypatch.setenv(serving.DIRTY_ENV, "0")
        out = tmp / f"c{i}"
        rc, fake = call(out, budget, f"knee-c{i}", *(["--resume", str(outs[-1])] if outs else []))
        assert rc == 0
        outs.append(out)
        fakes.append(fake)
        if doc(out)["stopped"] == "settled":
            return outs, fakes
    raise AssertionError("the search never settled")


def test_resumed_search_measures_the_same_points_once_and_ends_at_the_same_knee(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    monkeypatch.setenv(serving.DIRTY_ENV, "0")
    rc, whole = call(tmp_path / "whole", 100_000, "knee-whole")
    assert rc == 0 and {r: whole.measured(r) for r in RUNS} == WHOLE
    one = doc(tmp_path / "whole")
    assert one["calls"][0]["points"] == WHOLE and "merged_calls" not in one  # a single call: no merge
    outs, fakes = chain(tmp_path, 900, monkeypatch)
    assert len(outs) >= 3  # the budget really cut it, more than once
    measured = [(kind, run, rate) for f in fakes for kind, run, rate in f.calls if kind == "measure"]
    assert len(measured) == len(set(measured))  # no point measured twice
    for run in RUNS:
        assert [r for f in fakes for r in f.measured(run)] == WHOLE[run]  # the same points, in the same order
    last = doc(outs[-1])
    for run in RUNS:
        for key in ("goodput_text", "last_passing", "first_failing", "status", "curve"):
            assert last["runs"][run][key] == one["runs"][run][key], (run, key)
    assert len(last["calls"]) == len(outs) == last["merged_calls"]
    assert [c["call_id"] for c in last["calls"]] == [f"knee-c{i}" for i in range(len(outs))]
    for c, f in zip(last["calls"], fakes, strict=True):  # per call: what it measured, its commit and date
        assert c["points"] == {run: f.measured(run) for run in RUNS}
        assert c["git_commit"] == "a" * 40 and c["git_dirty"] is False and c["date"]
    assert not last["commits_differ"] and f"PANEL MERGES {len(outs)} CALLS" in " ".join(last["warnings"])
    # the last folder reads on its own: every report, the earlier calls' files under calls/
    assert len(list(outs[-1].glob("gp_*_k*.json"))) == 3 * sum(len(v) for v in WHOLE.values())
    assert (outs[-1] / "calls" / "knee-c0" / "knee.json").exists()
    table = (outs[-1] / "goodput.txt").read_text()
    assert f"panel merges {len(outs)} calls" in table and "knee-c0" in table
    assert "CALLS RAN DIFFERENT COMMITS" not in table
    gp = doc(outs[-1], "goodput.json")
    assert gp["runs"]["fcfs-recompute"]["goodput_text"] == one["runs"]["fcfs-recompute"]["goodput_text"] == "5"
    assert gp["knee_calls"]["merged_calls"] == len(outs) and gp["provenance"]["calls"]["knee-c0"] > 0


def test_commits_that_differ_are_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outs, _ = chain(tmp_path, 1500, monkeypatch, commit=lambda i: ("a" if i == 0 else "b") * 40)
    last = doc(outs[-1])
    assert last["commits_differ"] and [c["git_commit"][0] for c in last["calls"]] == ["a"] + ["b"] * (len(outs) - 1)
    flag = "CALLS RAN DIFFERENT COMMITS: aaaaaaaaaaaa (knee-c0), bbbbbbbbbbbb"
    assert any(w.startswith(flag) for w in last["warnings"])
    gp = doc(outs[-1], "goodput.json")
    assert gp["knee_calls"]["commits_differ"] and any("PANEL MIXES COMMITS" in w for w in gp["provenance"]["warnings"])
    assert "!!! CALLS RAN DIFFERENT COMMITS" in (outs[-1] / "goodput.txt").read_text()


def test_a_killed_call_is_resumed_without_its_partial_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    with pytest.raises(Killed):
        call(tmp_path / "c0", 100_000, "knee-c0", kill_at=3)  # fcfs 2, 4, 6 done; killed in 5's first repeat
    first = doc(tmp_path / "c0")
    assert first["runs"]["fcfs-recompute"]["curve"] == {"2": 1.0, "4": 1.0, "6": 0.5}
    assert (tmp_path / "c0" / "gp_fcfs-recompute_r5_k0.json").exists()
    rc, fake = call(tmp_path / "c1", 100_000, "knee-c1", "--resume", str(tmp_path / "c0"))
    assert rc == 0
    assert fake.measured("fcfs-recompute") == [5, 5.5] and fake.measured("lvf-rotate") == WHOLE["lvf-rotate"]
    assert (tmp_path / "c1" / "calls" / "knee-c0" / "gp_fcfs-recompute_r5_k0.json").exists()  # kept, not read
    assert json.loads((tmp_path / "c1" / "gp_fcfs-recompute_r5_k0.json").read_text())["call_id"] == "knee-c1"
    assert doc(tmp_path / "c1")["runs"]["fcfs-recompute"]["goodput_text"] == "5"


@pytest.mark.parametrize(("flags", "field"), [
    (["--max-out", "16"], "max_out (--max-out)"),
    (["--grid", "2", "4", "6"], "grid (--grid"),
    (["--seconds", "40"], "seconds (--seconds)"),
    (["--runs", "fcfs-recompute"], "runs (--runs)"),
    (["--server-arg=--max-total-tokens", "--server-arg=8192"], "server_arg (--server-arg)"),
    (["--ttft", "2"], "ttft (--ttft)"),
])
def test_a_plan_that_differs_is_refused_naming_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], flags: list[str],
                                                         field: str) -> None:
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    assert call(tmp_path / "c0", 900, "knee-c0")[0] == 0
    capsys.readouterr()
    rc, fake = call(tmp_path / "c1", 900, "knee-c1", "--resume", str(tmp_path / "c0"), *flags)
    err = capsys.readouterr().err
    assert rc == 2 and f"the plan differs in {field}" in err and not fake.calls
    assert not (tmp_path / "c1" / "knee.json").exists()


def test_reports_that_do_not_fit_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    c0 = tmp_path / "c0"
    assert call(c0, 900, "knee-c0")[0] == 0
    resume = ["--resume", str(c0)]
    assert call(c0, 900, "knee-c1", *resume)[0] == 2 and "separate folders" in capsys.readouterr().err
    assert call(tmp_path / "c1", 900, "knee-c0", *resume)[0] == 2 and "own id" in capsys.readouterr().err
    rp = c0 / "gp_fcfs-recompute_r2_k1.json"
    report = json.loads(rp.read_text())
    rp.write_text(json.dumps({**report, "config": {**report["config"], "trace_offset": 7}}))
    assert call(tmp_path / "c2", 900, "knee-c2", *resume)[0] == 2
    assert "gp_fcfs-recompute_r2_k1.json ran with config.trace_offset 7" in capsys.readouterr().err
    rp.unlink()
    assert call(tmp_path / "c3", 900, "knee-c3", *resume)[0] == 2
    assert "gp_fcfs-recompute_r2_k1.json of a measured point cannot be read" in capsys.readouterr().err


# ---- run variants (POLICY-MODE.VARIANT, --variant NAME=ARGS) -----------------------------------------------------
FIXED = "fixed=--offload-executor local --offload-ratio 0.5 --executor-mem-gb 7"
VARIED = ["--runs", "fcfs-recompute", "lvf-rotate", "fcfs-recompute.fixed", "--variant", FIXED]


def test_a_variant_is_one_more_run_on_the_same_rows_named_with_its_args_in_the_reports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """fcfs-recompute.fixed is searched like the other runs (its own knee, the union rule), its server gets the
    variant's args, knee.json and goodput.txt name the variant and its args, the ratio divides by plain fcfs,
    and a call resumes it."""
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    att = knees(**{"fcfs-recompute": 5.3, "lvf-rotate": 6.7, "fcfs-recompute.fixed": 4.2})
    argv = [*ARGS, *VARIED, "--budget-s", "100000", "--call-id", "knee-v", "--out", str(tmp_path / "v")]
    a = K.build_parser().parse_args(argv)
    plan = K.Plan(tuple(a.grid), a.repeats, a.seconds, a.min_req, a.target, K.TOLERANCE, a.extend)
    clock = Clock()
    fake = Reporting(a, plan, clock, att, "knee-v")
    a.out.mkdir(parents=True)
    assert K.main(argv, executor=fake, clock=clock) == 0
    assert fake.measured("fcfs-recompute.fixed") == [2, 4, 5, 4.5, 4.25]  # 5: fcfs's bisection point (union)
    d = doc(a.out)
    assert [d["runs"][r]["goodput_text"] for r in ("fcfs-recompute.fixed", "fcfs-recompute")] == ["4", "5"]
    args = ["--offload-executor", "local", "--offload-ratio", "0.5", "--executor-mem-gb", "7"]
    assert d["variants"] == {"fixed": args}
    fixed, off = d["servers"]["fcfs-recompute.fixed"], d["servers"]["fcfs-recompute"]
    assert fixed == [*off, *args]
    # the same rows and arrivals as the plain run at every rate and repeat
    for k in range(3):
        v = json.loads((a.out / f"gp_fcfs-recompute.fixed_r4_k{k}.json").read_text())["config"]
        p = json.loads((a.out / f"gp_fcfs-recompute_r4_k{k}.json").read_text())["config"]
        assert {x: v[x] for x in REPORT_SAME} == {x: p[x] for x in REPORT_SAME}
    text = (a.out / "goodput.txt").read_text()
    assert "fcfs-recompute.fixed: variant fixed: --offload-executor local --offload-ratio 0.5 --executor-mem-gb 7" \
        in text and "  fcfs-recompute: no variant" in text
    assert "goodput ratio fcfs-recompute.fixed / fcfs-recompute: 0.80x" in text  # the plain run is the baseline
    gp = doc(a.out, "goodput.json")
    assert gp["variants"]["fixed"][0] == "--offload-executor" and gp["servers"]["fcfs-recompute.fixed"] == fixed
    # resumed with the same variant: nothing left to run; with other args: refused, naming the flag
    rc, again = call(tmp_path / "v2", 900, "knee-v2", *VARIED, "--resume", str(a.out))
    assert rc == 0 and not [c for c in again.calls if c[0] == "measure"]
    capsys.readouterr()
    rc, _ = call(tmp_path / "v3", 900, "knee-v3", *VARIED[:-1], FIXED.replace("0.5", "0.4"), "--resume", str(a.out))
    assert rc == 2 and "the plan differs in variant (--variant)" in capsys.readouterr().err


REPORT_SAME = ("trace", "trace_offset", "seed", "num_requests", "request_rate", "arrival", "max_input_len")


def test_a_folder_from_before_variants_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """knee.json written before --variant has no "variant" setting: it reads as none, so it still resumes."""
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    assert call(tmp_path / "c0", 900, "knee-c0")[0] == 0
    d = doc(tmp_path / "c0")
    del d["setting"]["variant"]
    (tmp_path / "c0" / "knee.json").write_text(json.dumps(d))
    assert call(tmp_path / "c1", 900, "knee-c1", "--resume", str(tmp_path / "c0"))[0] == 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--runs", "fcfs-recompute.fixed"], "names variant 'fixed', which no --variant defines"),
    (["--runs", "fcfs-recompute", "--variant", FIXED], "--variant fixed: no run uses it"),
    (["--runs", "fcfs-recompute.fixed", "--variant", "fixed="], "--variant fixed: no launcher args"),
    (["--runs", "fcfs-recompute.a.b"], "is not POLICY-MODE or POLICY-MODE.VARIANT"),
    (["--runs", "fcfs-recompute.x", "--variant", "a-b=--x 1"], "NAME letters, digits and _"),
    (["--runs", "fcfs-recompute.x", "--variant", "x=--a", "--variant", "x=--b"], "--variant x: defined twice"),
    (["--runs", "fcfs-recompute", "fcfs-recompute"], "'fcfs-recompute' given twice"),
    (["--runs", "fcfs-recompute.x", "--variant", "x=--a 'b"], "cannot split its args"),
])
def test_bad_variants_are_refused_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  flags: list[str], message: str) -> None:
    assert K.main([*ARGS, *flags, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "knee.json").exists()


def test_a_resume_on_another_card_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    monkeypatch.setenv(serving.DIRTY_ENV, "0")
    monkeypatch.setattr(K.R, "gpu_name", lambda device: "NVIDIA H200")
    assert call(tmp_path / "c0", 900, "knee-c0")[0] == 0
    assert doc(tmp_path / "c0")["gpu"] == doc(tmp_path / "c0")["calls"][0]["gpu"] == "NVIDIA H200"
    monkeypatch.setattr(K.R, "gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
    rc, _ = call(tmp_path / "c1", 900, "knee-c1", "--resume", str(tmp_path / "c0"))
    assert rc == 2 and "never merges cards" in capsys.readouterr().err
    monkeypatch.setattr(K.R, "gpu_name", lambda device: "NVIDIA H200")  # the same card resumes
    assert call(tmp_path / "c2", 900, "knee-c2", "--resume", str(tmp_path / "c0"))[0] == 0
    assert [c["gpu"] for c in doc(tmp_path / "c2")["calls"]] == ["NVIDIA H200"] * 2
    assert "NVIDIA H200  points:" in (tmp_path / "c2" / "goodput.txt").read_text()


def test_the_physical_card_is_recorded_and_a_panel_says_when_one_card_ran_every_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs' points can outlast one call; the nearest is consecutive calls on one card at one commit,
    which the panel then says (and warns when the calls ran on different physical cards)."""
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    monkeypatch.setenv(serving.DIRTY_ENV, "0")
    monkeypatch.setattr(K.R, "gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(K.R, "gpu_uuid", lambda device: "GPU-1111aaaa-2222")
    assert call(tmp_path / "c0", 900, "knee-c0")[0] == 0
    assert doc(tmp_path / "c0")["gpu_uuid"] == doc(tmp_path / "c0")["calls"][0]["gpu_uuid"] == "GPU-1111aaaa-2222"
    assert "one physical card" not in (tmp_path / "c0" / "goodput.txt").read_text()  # one call: nothing to say
    assert call(tmp_path / "c1", 900, "knee-c1", "--resume", str(tmp_path / "c0"))[0] == 0
    text = (tmp_path / "c1" / "goodput.txt").read_text()
    assert "NVIDIA H100 80GB HBM3 GPU-1111aaa" in text
    assert "every call on one physical card at one clean commit: consecutive calls, not one call" in text
    assert doc(tmp_path / "c1")["one_card_one_commit"] is True
    monkeypatch.setattr(K.R, "gpu_uuid", lambda device: "GPU-3333bbbb-4444")  # the same model, another card
    assert call(tmp_path / "c2", 900, "knee-c2", "--resume", str(tmp_path / "c1"))[0] == 0
    d = doc(tmp_path / "c2")
    assert d["one_card_one_commit"] is False
    assert any(w.startswith("CALLS RAN ON 2 PHYSICAL CARDS") for w in d["warnings"])
    assert "one physical card" not in (tmp_path / "c2" / "goodput.txt").read_text()


def test_earlier_calls_without_a_recorded_card_are_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(serving.COMMIT_ENV, "a" * 40)
    monkeypatch.setenv(serving.DIRTY_ENV, "0")
    monkeypatch.setattr(K.R, "gpu_name", lambda device: None)  # as folders from before 2026-12-06 read
    assert call(tmp_path / "c0", 900, "knee-c0")[0] == 0
    monkeypatch.setattr(K.R, "gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert call(tmp_path / "c1", 900, "knee-c1", "--resume", str(tmp_path / "c0"))[0] == 0
    warnings = " ".join(doc(tmp_path / "c1")["warnings"])
    assert "GPU NOT RECORDED for earlier calls knee-c0" in warnings and "NVIDIA H100 80GB HBM3" in warnings
    assert "GPU not recorded" in (tmp_path / "c1" / "goodput.txt").read_text()


def test_gpu_name_asks_nvidia_smi_for_the_visible_card(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from bench import knee_resume as R

    assert R.gpu_name("cpu") == "cpu" and R.gpu_uuid("cpu") is None
    seen: list[list[str]] = []

    def smi(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "NVIDIA H200\n", "")

    monkeypatch.setattr(R.subprocess, "run", smi)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")  # torch's cuda:1 is the physical card 2
    assert R.gpu_name("cuda") == "NVIDIA H200" and seen[-1][-2:] == ["-i", "3"]
    assert R.gpu_name("cuda:1") == "NVIDIA H200" and seen[-1][-2:] == ["-i", "2"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert R.gpu_name("cuda:1") == "NVIDIA H200" and seen[-1][-2:] == ["-i", "1"]

    def missing(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(R.subprocess, "run", missing)
    assert R.gpu_name("cuda") is None


def test_knee_carry_unpacks_a_call_for_the_next_resume(tmp_path: Path) -> None:
    """bench/knee_carry.sh: the knee step's archive from a call's files, unpacked where RESUME points."""
    import os
    import subprocess
    import tarfile

    root = Path(__file__).resolve().parents[1]
    knee = tmp_path / "src" / "knee"
    knee.mkdir(parents=True)
    (knee / "knee.json").write_text(json.dumps({"stopped": "budget", "calls": [{"call_id": "c0"}]}))
    files = tmp_path / "device" / "9"
    files.mkdir(parents=True)
    with tarfile.open(files / "knee.tgz", "w:gz") as t:
        t.add(knee, arcname="knee")
    name = f"pytest-carry-{tmp_path.name}"
    dst = root / "bench" / "results" / "tmp" / name
    try:
        out = subprocess.run(["bash", "bench/knee_carry.sh", name], cwd=root, capture_output=True, text=True,
                             env={**os.environ, "DEVICE_FILES": str(tmp_path / "device")})
        assert out.returncode == 0, out.stderr
        assert f"RESUME=bench/results/tmp/{name}" in out.stdout and "stopped: budget | calls: 1" in out.stdout
        assert json.loads((dst / "knee.json").read_text())["stopped"] == "budget"
        bad = subprocess.run(["bash", "bench/knee_carry.sh", name, str(tmp_path)], cwd=root, capture_output=True,
                             text=True)
        assert bad.returncode == 2 and "no knee.tgz" in bad.stderr
    finally:
        import shutil

        shutil.rmtree(dst, ignore_errors=True)
