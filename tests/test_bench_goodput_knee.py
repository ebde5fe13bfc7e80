"""bench/goodput_knee.py: the plan's offsets (the same rows for every run), the bisection against synthetic
attainment functions (no server), the union rule, the budget stop, and one short run on CPU against the
embedded model."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import goodput_knee as K
from bench import serving, step_profile


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Fake:
    """An executor whose attainment is a function of (run, rate); it advances a fake clock as a real one would."""

    def __init__(self, plan: K.Plan, clock: Clock, att: Callable[[str, float], float],
                 fail_start: str | None = None) -> None:
        self.plan, self.clock, self.att, self.fail_start = plan, clock, att, fail_start
        self.calls: list[tuple[str, str, float]] = []

    def start(self, run: str) -> None:
        self.calls.append(("start", run, 0.0))
        if run == self.fail_start:
            raise RuntimeError("server exited")
        self.clock.t += 30

    def stop(self, run: str) -> None:
        self.calls.append(("stop", run, 0.0))

    def measure(self, run: str, rate: float) -> float:
        self.calls.append(("measure", run, rate))
        self.clock.t += self.plan.repeats * (self.plan.n(rate) / rate + 10)
        return self.att(run, rate)

    def measured(self, run: str) -> list[float]:
        return [r for kind, name, r in self.calls if kind == "measure" and name == run]


def knees(**knee: float) -> Callable[[str, float], float]:
    return lambda run, rate: 1.0 if rate <= knee[run] else 0.5


def test_plan_offsets_are_the_same_for_every_run() -> None:
    plan = K.Plan((4, 2, 6), repeats=3, seconds=30, extend=1)
    assert plan.rates == (2, 4, 6) and plan.extension() == (8,)
    assert plan.n(2) == 150 and plan.n(6) == 180 and plan.n(8) == 240
    assert plan.stride == 240 and [plan.offset(k) for k in range(3)] == [0, 240, 480]  # stride >= every n
    args = K.build_parser().parse_args(["--trace", "mooncake"])

    def argv(run: str, rate: float, k: int) -> dict[str, object]:
        a = K.serving_argv(args, plan, run, rate, k, "http://127.0.0.1:1", Path("/o"), "call")
        return vars(serving.build_parser().parse_args(a))  # what serving.py will run

    for rate in (2.0, 5.0):
        for k in range(3):
            f, lv = argv("fcfs-recompute", rate, k), argv("lvf-rotate", rate, k)
            same = ("trace", "trace_offset", "seed", "num_requests", "request_rate", "arrival", "max_input_len")
            assert [f[x] for x in same] == [lv[x] for x in same]
            assert (f["trace_offset"], f["seed"], f["num_requests"]) == (240 * k, k, 150)
            assert f["output_json"] == Path(f"/o/gp_fcfs-recompute_r{rate:g}_k{k}.json") and f["call_id"] == "call"
    assert argv("a-b", 2.0, 0)["max_duration"] == 75 + 5 + 26 + 15  # span + TTFT + 256 x TPOT + 15
    server = K.server_argv(args, "lvf-rotate")
    assert server[server.index("--schedule-policy") + 1] == "lvf" and "--kv-host-size-gb" in server
    assert "--kv-host-size-gb" not in K.server_argv(args, "fcfs-recompute")
    with pytest.raises(ValueError):
        K.Plan(())


def test_bracket_and_next_rate() -> None:
    plan = K.Plan((2, 4, 6))
    assert K.next_rate({}, [], plan) == 2
    assert K.next_rate({2: 1.0, 4: 0.95}, [], plan) == 6
    assert K.next_rate({2: 1.0, 4: 0.95, 6: 0.95}, [], plan) == 8  # every grid rate passed: one step above
    assert K.next_rate({2: 1.0, 4: 0.95, 6: 0.95, 8: 0.91}, [], plan) is None  # a lower bound
    assert K.bracket({2: 1.0, 4: 0.5, 6: 0.95}, 0.9) == (2, 4)  # a pass above a failure does not count
    assert K.next_rate({2: 1.0, 4: 0.5, 6: 0.95}, [], plan) == 3
    assert K.next_rate({2: 1.0, 4: 0.5}, [3.5, 5], plan) == 3.5  # another run's rate below hi first; 5 never
    assert K.next_rate({2: 0.5}, [], plan) is None  # the lowest failed: "< 2"
    assert K.next_rate({2: 1.0, 4: 1.0, 6: 0.5, 5: 1.0, 5.5: 0.5}, [], plan) is None  # 5.5 <= 5 x 1.1
    assert K.next_rate({2: 1.0, 4: 1.0, 6: 0.5, 5: 1.0}, [], plan) == 5.5
    one = K.Plan((2.125,), extend=0)  # a call of one bisection point (EXTEND=0 in bench/gpu_session.sh)
    assert K.next_rate({2.125: 0.97}, [], one) is None and K.status({2.125: 0.97}, [], one).startswith("lower bound")
    assert K.next_rate({2.125: 0.97}, [], K.Plan((2.125,))) == 3.188  # extend 1: half the rate above it


def test_search_bisects_to_ten_percent_and_shares_points() -> None:
    plan = K.Plan((2, 4, 6, 8), repeats=3)
    clock = Clock()
    fake = Fake(plan, clock, knees(**{"fcfs-recompute": 5.3, "lvf-rotate": 6.7}))
    s = K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake, 10_000, clock=clock).run()
    assert fake.measured("fcfs-recompute") == [2, 4, 6, 5, 5.5]
    assert fake.measured("lvf-rotate") == [2, 4, 5, 5.5, 6, 8, 7, 6.5]  # fcfs's bisection points too
    summary = s.summary()
    f, lv = summary["runs"]["fcfs-recompute"], summary["runs"]["lvf-rotate"]
    assert (f["goodput_rps"], f["first_failing"], f["status"]) == (5.0, 5.5, "converged")
    assert (lv["goodput_rps"], lv["first_failing"], lv["status"]) == (6.5, 7.0, "converged")
    assert lv["first_failing"] <= lv["last_passing"] * 1.1 and summary["stopped"] == "settled"
    assert [c[1] for c in fake.calls if c[0] == "start"] == ["fcfs-recompute", "lvf-rotate"]  # one server each


def test_later_pass_runs_another_runs_points_below_its_failure() -> None:
    """lvf's bisection lands below fcfs's first failure: fcfs's server comes back for those rates."""
    plan = K.Plan((2, 6), repeats=1)
    clock = Clock()
    fake = Fake(plan, clock, knees(**{"fcfs-recompute": 5.3, "lvf-rotate": 3.6}))
    s = K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake, 10_000, clock=clock).run()
    assert fake.measured("fcfs-recompute") == [2, 6, 4, 5, 5.5, 3, 3.5, 3.75]
    assert fake.measured("lvf-rotate") == [2, 4, 3, 3.5, 3.75]  # 5, 5.5 and 6: above its failure at 4
    assert [c[1] for c in fake.calls if c[0] == "start"] == ["fcfs-recompute", "lvf-rotate", "fcfs-recompute"]
    assert s.summary()["runs"]["lvf-rotate"]["goodput_rps"] == 3.5


def test_non_monotone_curve_caps_goodput() -> None:
    plan = K.Plan((2, 4, 6), repeats=1)
    clock = Clock()
    fake = Fake(plan, clock, lambda run, rate: 0.5 if 2.5 < rate <= 4 else 1.0)
    s = K.Search(plan, ["fcfs-recompute"], fake, 10_000, clock=clock).run()
    assert fake.measured("fcfs-recompute") == [2, 4, 3, 2.5, 2.75]  # 6 is never run: it cannot raise the goodput
    assert s.summary()["runs"]["fcfs-recompute"]["goodput_rps"] == 2.5


def test_budget_stops_cleanly_and_says_where() -> None:
    plan = K.Plan((2, 4, 6), repeats=3, seconds=30)  # a point at 2 req/s: 3 x (75 + 10) s
    clock = Clock()
    fake = Fake(plan, clock, knees(**{"fcfs-recompute": 5.3, "lvf-rotate": 6.7}))
    s = K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake, 800, clock=clock).run()
    summary = s.summary()
    assert summary["stopped"] == "budget" and clock.t <= 800
    f, lv = summary["runs"]["fcfs-recompute"], summary["runs"]["lvf-rotate"]
    assert fake.measured("fcfs-recompute") == [2] and f["next_rate"] == 4 and f["status"] == "stopped by the budget"
    assert fake.measured("lvf-rotate") == [2, 4] and lv["next_rate"] == 6  # it had the time fcfs left over


def test_a_point_longer_than_any_share_still_runs_and_the_next_call_starts_with_the_run_it_cut() -> None:
    # 3 x 150 requests at 1.375 req/s: ~357 s a point, more than half of a 560 s call. The first run's first
    # point takes the call; the second run is cut, and the cursor a resumed call starts from names it.
    plan = K.Plan((1.375, 1.75), repeats=3, min_req=150, seconds=20)
    clock = Clock()
    fake = Fake(plan, clock, knees(**{"fcfs-recompute": 1.5, "lvf-rotate": 2.0}))
    s = K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake, 545, clock=clock).run()
    assert fake.measured("fcfs-recompute") == [1.375] and fake.measured("lvf-rotate") == []
    assert s.stopped == "budget" and clock.t <= 545
    at = s.resume_at
    assert at.todo is not None and at.todo[at.index] == "lvf-rotate"
    # Resumed with that cursor, lvf-rotate goes first.
    clock2 = Clock()
    fake2 = Fake(plan, clock2, knees(**{"fcfs-recompute": 1.5, "lvf-rotate": 2.0}))
    K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake2, 545, clock=clock2, state=s.state,
             start_at=at).run()
    assert fake2.measured("lvf-rotate") == [1.375] and fake2.measured("fcfs-recompute") == []


def test_first_gives_a_run_the_calls_first_turn_also_when_resumed(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    plan = K.Plan((1.375, 1.75), repeats=3, min_req=150, seconds=20)
    att = knees(**{"fcfs-recompute": 1.5, "lvf-rotate": 2.0})
    clock = Clock()
    fake = Fake(plan, clock, att)
    s = K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake, 545, clock=clock, first="lvf-rotate").run()
    assert fake.measured("lvf-rotate") == [1.375] and fake.measured("fcfs-recompute") == []
    assert s.resume_at.todo == ["lvf-rotate", "fcfs-recompute"] and s.resume_at.index == 1  # the cursor agrees
    # A resumed cursor whose next turn is fcfs's: --first moves lvf ahead of it.
    clock2 = Clock()
    fake2 = Fake(plan, clock2, att)
    start = K.Cursor(0, ["fcfs-recompute", "lvf-rotate"], 0)
    K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake2, 545, clock=clock2, start_at=start,
             first="lvf-rotate").run()
    assert [c[1] for c in fake2.calls if c[0] == "measure"][:1] == ["lvf-rotate"]
    # A run that is not one of --runs is a usage error.
    assert K.main(["--first", "lvf-swap", "--out", str(tmp_path)]) == 2
    assert "--first lvf-swap" in capsys.readouterr().err


def test_a_run_whose_server_fails_does_not_stop_the_others() -> None:
    plan = K.Plan((2, 4), repeats=1, extend=0)
    clock = Clock()
    fake = Fake(plan, clock, knees(**{"fcfs-recompute": 9, "lvf-rotate": 9}), fail_start="fcfs-recompute")
    summary = K.Search(plan, ["fcfs-recompute", "lvf-rotate"], fake, 10_000, clock=clock).run().summary()
    assert summary["runs"]["fcfs-recompute"]["status"].startswith("error: RuntimeError: server exited")
    assert summary["runs"]["lvf-rotate"]["goodput_text"] == ">= 4"


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert K.main(["--runs", "lvf", "--out", str(tmp_path)]) == 2
    assert "POLICY-MODE" in capsys.readouterr().err
    assert K.main(["--grid", "100", "--repeats", "3", "--out", str(tmp_path)]) == 2  # 3 x 3000 rows > the trace
    assert "rows" in capsys.readouterr().err


def test_end_to_end_on_cpu(tmp_path: Path) -> None:
    """Three runs against the embedded model, tiny rates, 6 requests a repeat, 2 repeats: the folder holds every
    report, knee.json and goodput.py's table, and every run replayed the same rows; the third is a variant
    (fcfs-recompute with an in-process executor whose share the adaptive policy moves)."""
    from tests._router_util import free_port

    out = tmp_path / "knee"
    t0 = time.monotonic()
    runs = ["fcfs-recompute", "lvf-rotate", "fcfs-recompute.adaptive"]
    # min_context_tokens 0: no context rule, so with no miss the share only rises and requests go out
    variant = ("adaptive=--offload-executor local --offload-ratio 0.5 --offload-policy adaptive "
               "--offload-adaptive '{\"min_context_tokens\": 0}'")
    rc = K.main(["--runs", *runs, "--variant", variant, "--grid", "2", "4", "--extend", "0", "--repeats", "2",
                 "--min-req", "6", "--seconds", "1", "--model", "", "--device", "cpu", "--dtype", "float32",
                 "--share", "0", "--host-gb", "1", "--port", str(free_port()), "--server-arg=--max-total-tokens",
                 "--server-arg=8192", "--step-log-s", "0.2", "--trace", "azure-conv",
                 "--max-in", "48", "--max-out", "4", "--vocab-size", "250", "--ttft", "10", "--tpot", "2",
                 "--budget-s", "240", "--call-id", "knee-cpu-test", "--out", str(out)])
    assert rc == 0, (out / "knee.json").read_text() if (out / "knee.json").exists() else "no knee.json"
    assert time.monotonic() - t0 < 300
    doc = json.loads((out / "knee.json").read_text())
    assert doc["stopped"] == "settled" and doc["call_id"] == "knee-cpu-test" and doc["plan"]["offsets"] == [0, 6]
    assert doc["warnings"] and "below the method's minimum" in doc["warnings"][0]
    for run in runs:
        assert doc["runs"][run]["status"] == "lower bound (every rate passed)"
        assert doc["runs"][run]["goodput_text"] == ">= 4"
    reports = {p.name: json.loads(p.read_text()) for p in out.glob("gp_*_k*.json")}
    assert len(reports) == 12
    for name, rep in reports.items():
        assert rep["call_id"] == "knee-cpu-test" and rep["git_commit"] != "unknown", name
        # the worker's own TTFT came back in meta_info, and the path outside it is what the client waited more
        m = rep["metrics"]
        assert 0 < m["server_ttft_ms"]["median"] <= m["ttft_ms"]["median"], name
        assert m["ttft_outside_worker_ms"]["median"] > 0, name
        assert 0 < m["server_tpot_ms"]["median"] <= 1.5 * m["tpot_ms"]["median"], name
    a, b, c = (reports[f"gp_{run}_r4_k1.json"] for run in runs)
    assert a["config"]["trace_offset"] == b["config"]["trace_offset"] == c["config"]["trace_offset"] == 6
    assert a["workload"]["mean_input_len"] == b["workload"]["mean_input_len"] == c["workload"]["mean_input_len"]
    text = (out / "goodput.txt").read_text()
    assert ">= 4" in text and "knee-cpu-test x12" in text and (out / "goodput.png").stat().st_size > 0
    assert ("fcfs-recompute.adaptive: variant adaptive: --offload-executor local --offload-ratio 0.5 "
            "--offload-policy adaptive --offload-adaptive '{\"min_context_tokens\": 0}'") in text
    def sent_bytes(run: str) -> float:  # the server's offload bytes out, from its /metrics at stop
        lines = (out / f"gp_metrics_{run}.txt").read_text().splitlines()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("sglang_ext:offload_bytes_total")
                   and 'direction="out"' in ln)

    assert sent_bytes("fcfs-recompute.adaptive") > 0 and sent_bytes("fcfs-recompute") == 0  # the variant's flags
    for run in runs:  # every server was warmed before its first point, outside every point's markers
        log = (out / f"gp_server_{run}.log").read_text()
        assert log.count(f"{step_profile.POINT_MARK} warm-up") >= 1
        assert log.index(f"{step_profile.POINT_MARK} warm-up") < log.index(f"{step_profile.POINT_MARK} begins")
    # each point's step profile, from the server logs between the search's markers
    steps = step_profile.folder_points(out)
    assert {p.run for p in steps} == set(runs) and all(p.steps > 0 and 0 < p.kv_peak <= 1 for p in steps)
    assert {(p.rate, p.repeat) for p in steps if p.run == "lvf-rotate"} <= {(2, 0), (2, 1), (4, 0), (4, 1)}


def test_variant_server_args_and_old_runs_unchanged() -> None:
    """A run without a variant gets exactly goodput_sweep.sh's flags (and --server-arg's); POLICY-MODE.NAME
    gets them plus the variant's, after --server-arg's (its flag wins); both replay the same serving rows."""
    a = K.build_parser().parse_args(["--model", "", "--device", "cpu", "--share", "0.25", "--server-arg=--x",
                                     "--variant", "v=--offload-executor local --offload-policy adaptive"])
    plain = K.server_argv(a, "fcfs-recompute")
    assert plain == ["--device", "cpu", "--dtype", "bfloat16", "--port", "31000", "--mem-fraction-static", "0.25",
                     "--schedule-policy", "fcfs", "--preemption-mode", "recompute", "--ttft-slo-ms", "5000",
                     "--tpot-slo-ms", "100", "--step-log-interval-s", "2", "--x"]
    assert K.server_argv(a, "fcfs-recompute.v") == [*plain, "--offload-executor", "local", "--offload-policy",
                                                    "adaptive"]
    rot = K.server_argv(a, "lvf-rotate.v")
    assert rot[rot.index("--schedule-policy") + 1] == "lvf" and "--kv-host-size-gb" in rot
    assert K.parse_run("lvf-rotate.v") == ("lvf", "rotate", "v") and K.parse_run("lvf-rotate").variant is None
    assert K.baseline(["lvf-rotate", "fcfs-recompute.v", "fcfs-recompute"]) == "fcfs-recompute"
    assert K.baseline(["lvf-rotate.v"]) is None


def test_an_moe_served_without_uniform_routing_is_warned() -> None:
    """Every knee search serves dummy weights: an MoE run without --moe-routing-simulation uniform gets a
    warning in knee.json (its decode is cheaper than a trained router's); dense models and runs with it none."""
    plain = ["--model-path", "preset:qwen3-30b-a3b", "--load-format", "dummy"]
    w = K.routing_warning("preset:qwen3-30b-a3b", {"fcfs-recompute": plain,
                                                   "lvf-rotate": [*plain, "--moe-routing-simulation=uniform"]})
    assert w is not None and "(fcfs-recompute)" in w and "MoE-realistic" in w
    both = {"fcfs-recompute": [*plain, "--moe-routing-simulation", "uniform"]}
    assert K.routing_warning("preset:qwen3-30b-a3b", both) is None
    assert K.routing_warning("preset:llama-3-8b", {"fcfs-recompute": plain}) is None
    assert K.routing_warning("", {"fcfs-recompute": []}) is None  # the embedded model


def test_a_warm_up_the_server_refuses_is_an_error_and_no_server_warmup_sends_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ServerExecutor.warm: a prompt answered with an error status raises (the run then fails with its
    message, not a point measured on an unwarmed server); --no-server-warmup skips every prompt."""
    sent: list[int] = []

    def refuse(url: str, method: str = "GET", timeout: float = 5.0, body: dict | None = None) -> tuple[int, str]:
        sent.append(len(body["input_ids"]) if body else 0)
        return 400, '{"error": {"message": "bad prompt"}}'

    monkeypatch.setattr(K, "_http", refuse)
    plan = K.Plan((2,), repeats=1, seconds=30)
    a = K.build_parser().parse_args(["--model", "", "--device", "cpu", "--max-in", "64"])
    ex = K.ServerExecutor(a, plan, tmp_path, "call")
    with pytest.raises(OSError, match=r"warm-up prompt of 1 tokens: HTTP 400: .*bad prompt"):
        ex.warm("fcfs-recompute")
    assert sent == [1]
    sent.clear()
    a = K.build_parser().parse_args(["--model", "", "--device", "cpu", "--max-in", "64", "--no-server-warmup"])
    K.ServerExecutor(a, plan, tmp_path, "call").warm("fcfs-recompute")
    assert sent == []


@pytest.mark.parametrize("flags, runs_point", [([], False), (["--est-start-s", "5"], True)])
def test_first_estimates_decide_whether_a_last_point_starts(tmp_path: Path, flags: list[str],
                                                            runs_point: bool) -> None:
    """Session 18's c7: 283 s left, one point of 3 x 150 requests at 2.5 req/s. With the default guesses (a
    60 s start, 15 s a repeat) it is estimated at 285 s and not started; told the server starts in ~5 s, the
    search runs it (230 s estimated)."""
    plan = K.Plan((2.5,), repeats=3, seconds=20, min_req=150, extend=0)
    clock = Clock()
    fake = Fake(plan, clock, knees(**{"fcfs-recompute": 9}))
    K.main(["--runs", "fcfs-recompute", "--grid", "2.5", "--extend", "0", "--repeats", "3", "--min-req", "150",
            "--seconds", "20", "--budget-s", "283", "--call-id", "knee-est-test", "--out", str(tmp_path / "k"),
            *flags], executor=fake, clock=clock)
    doc = json.loads((tmp_path / "k" / "knee.json").read_text())
    assert fake.measured("fcfs-recompute") == ([2.5] if runs_point else [])
    assert doc["stopped"] == ("settled" if runs_point else "budget")
    assert doc["estimator"]["start_s"] == (30.0 if runs_point else 60.0)  # then what the fake start took


def test_negative_estimates_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert K.main(["--est-overhead-s", "-1", "--out", str(tmp_path)]) == 2
    assert "--est-overhead-s" in capsys.readouterr().err
