"""bench/sim/open_runs.py: issue 32's open rows predicted on the simulator, with a GPU grid on the
predicted bracket and the device time that grid would cost (small plans, so a CPU test)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim import knee as N
from bench.sim import open_runs as O
from bench.sim.cost import DEFAULT_CALIBRATION, CostModel


def test_suggested_grid_is_every_bracket_and_a_guard_below() -> None:
    good = {"fcfs-recompute": {"goodput": 4.75, "first_failing": 5.0},
            "lvf-rotate": {"goodput": 5.0, "first_failing": 5.5}}
    # 4.75 / 1.1 = 4.32, rounded down to a quarter
    assert O.suggested_grid(good, 0.1) == (4.25, 4.75, 5.0, 5.5)
    # a lower bound (nothing failed) and a run below its lowest rate add what they know
    good = {"a": {"goodput": 1.5, "first_failing": None}, "b": {"goodput": None, "first_failing": 1.0}}
    assert O.suggested_grid(good, 0.1) == (1.0, 1.25, 1.5)  # 1.5 / 1.1 = 1.36, down to an eighth
    assert O.suggested_grid({"a": {"goodput": None, "first_failing": None}}, 0.1) == ()
    assert O.suggested_grid({"a": {"goodput": 0.1, "first_failing": 0.2}}, 0.1) == (0.1, 0.2)  # no guard at 0
    # two guard steps (TTFT 2 s rows): 4.75 / 1.21 = 3.93, down to 3.75
    assert O.suggested_grid(good2 := {"a": {"goodput": 4.75, "first_failing": 5.0}}, 0.1, 2) == (3.75, 4.75, 5.0)
    # rates measured by earlier calls leave the grid, and a measured rate under the knee replaces the guard
    assert O.suggested_grid(good2, 0.1, 2, (4.0, 5.0)) == (4.75,)
    assert O.suggested_grid(good2, 0.1, 1, (5.0,)) == (4.25, 4.75)


def test_pools_come_from_the_logged_servers_at_each_share() -> None:
    for share in (0.125, 0.25, 0.5):
        tokens, source = O.pool_at(share)
        assert "gp_server_" in source and tokens % 16 == 0
    # a larger share holds a larger pool (weights are the same)
    assert O.pool_at(0.125)[0] < O.pool_at(0.25)[0] < O.pool_at(0.5)[0]


def test_rows_are_the_open_rows_and_their_commands_are_gpu_session_calls() -> None:
    rows = {r.row: r for r in O.rows()}
    assert set(rows) == {"1", "2+7", "3+7", "4", "5", "6", "8", "8h"}
    assert rows["8"].runs == ("fcfs-recompute",) and rows["8"].setting.trace == "azure-conv"
    # rotate vs recompute at two shares within the bound of 4 models a GPU; 1/8 is marked past it
    assert {rows[r].share for r in ("2+7", "3+7")} == {0.25, 0.5}
    assert all(rows[r].runs == ("fcfs-recompute", "lvf-rotate", "fcfs-rotate") for r in ("2+7", "3+7"))
    assert all(r.share >= 0.25 or "not a result" in r.note for r in rows.values())
    assert rows["1"].measured == (4.0, 5.0) and {r.row for r in rows.values() if r.guard_steps == 2} == {"1", "4"}
    cmd = O.gpu_command(rows["5"], (3.5, 4.0))
    assert 'RUNS="fcfs-recompute lvf-rotate" SHARE=0.25' in cmd and "ARRIVAL=burst" in cmd
    assert 'GRID="3.5 4"' in cmd and cmd.endswith("bash bench/gpu_session.sh warm knee")


def test_visits_follow_the_union_rule_up_to_each_first_failure() -> None:
    good = {"a": {"goodput": 4.75, "first_failing": 5.0}, "b": {"goodput": 5.5, "first_failing": None}}
    assert O.visits(good, (4.25, 4.75, 5.0, 5.5)) == {"a": [4.25, 4.75, 5.0], "b": [4.25, 4.75, 5.0, 5.5]}


def test_a_row_is_searched_and_its_gpu_call_estimated(capsys: pytest.CaptureFixture[str]) -> None:
    # one request every 2 s passes at a quarter share; 60 ~6K-token prompts at 120 req/s cannot (the
    # 8B prefills well under 70K tokens/s: the last ones wait past the 5 s TTFT)
    row = O.Row("t", N.Setting("t", "mooncake", "poisson", (0.5, 120.0), 7680), 0.25, O.LVF)
    a = argparse.Namespace(repeats=1, seconds=0.5, min_req=6, extend=0, tolerance=100.0, gpu="h200")
    r = O.predict_row(row, CostModel.load(DEFAULT_CALIBRATION, O.MODEL), a)
    for run in O.LVF:
        g = r["search"]["goodput"][run]
        assert g["goodput"] is not None and g["first_failing"] is not None
        assert g["goodput"] in r["suggested_grid"] and g["first_failing"] in r["suggested_grid"]
    est = r["device_estimate"]
    assert est["visits"] == O.visits(r["search"]["goodput"], tuple(r["suggested_grid"]))
    spans = [p["mean"]["end_s"] for p in r["search"]["points"]]
    assert 2 * O.SERVER_START_S + est["points"] * min(spans) <= est["seconds"]
    assert est["seconds"] <= 2 * O.SERVER_START_S + est["points"] * (max(spans) + O.REPEAT_OVERHEAD_S) + 1
    assert est["calls"] >= 1 and r["gpu_command"].startswith('RUNS="fcfs-recompute lvf-rotate" SHARE=0.25')
    assert "suggested GRID" in capsys.readouterr().out


def test_a_row_below_its_grid_searches_lower_reusing_its_points() -> None:
    # 60 ~6K-token prompts at 120 req/s fail (above); the search adds 60 req/s, then 30, until a rate passes
    row = O.Row("t", N.Setting("t", "mooncake", "poisson", (120.0, 240.0), 7680), 0.25, O.LVF)
    a = argparse.Namespace(repeats=1, seconds=0.5, min_req=6, extend=0, tolerance=100.0, gpu="h200")
    r = O.predict_row(row, CostModel.load(DEFAULT_CALIBRATION, O.MODEL), a)
    grid = r["search"]["plan"]["grid"]
    assert grid[-2:] == [120.0, 240.0] and min(grid) < 120.0 and r["search"]["plan"]["offsets"] == [0]
    for run in O.LVF:
        g = r["search"]["goodput"][run]
        assert g["goodput"] is not None and g["goodput"] < 120.0 and g["goodput"] in grid
    seen = [(p["run"], p["rate"]) for p in r["search"]["points"]]
    assert len(seen) == len(set(seen))  # the first search's points were taken, not replayed again


def test_another_card_takes_its_own_pools_and_rows() -> None:
    """--gpu h100: the pool at 1/2 is the H100 server's logged one, other shares come from the memory math
    with the card's total solved from that log (H100 80GB: torch sees ~79.2 GiB); every row is a new panel."""
    tokens, source = O.pool_at(0.5, gpu="h100")
    # any H100 server log at 1/2 (2026-12-06 session 3's, 2026-12-07 session 16's: the same 12,291 pages)
    assert tokens == (12291 - 1) * 16 and "-h100-" in source and "gp_server" in source
    total, other = O.memory_for("h100")
    assert 79.0 * 2**30 < total < 79.4 * 2**30 and other == O.memory_for("h200")[1]
    quarter, source = O.pool_at(0.25, gpu="h100")
    assert source.startswith("memory math") and "h100" in source and 30_000 < quarter < 40_000
    assert O.pool_at(0.25)[0] > 4 * quarter  # the H200's quarter holds far more
    assert all(r.measured == () for r in O.rows("h100")) and O.rows("h200")[0].measured == (4.0, 5.0)
    with pytest.raises(ValueError, match="no server log"):
        O.memory_for("h300")


def test_an_unknown_card_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert O.main(["--gpu", "a100", "--rows", "1", "--out", str(tmp_path)]) == 2
    assert "unknown GPU 'a100'" in capsys.readouterr().err


def test_a_share_the_weights_fill_is_skipped_not_searched() -> None:
    row = next(r for r in O.rows("h100") if r.row == "6")  # 1/8 of an H100: under Llama-3-8B's 15 GiB
    a = argparse.Namespace(repeats=1, seconds=0.5, min_req=6, extend=0, tolerance=100.0, gpu="h100")
    out = O.predict_row(row, CostModel.load(O.gpu_calibration("h100")[0], O.MODEL), a)
    assert "does not fit" in out["skipped"] and "search" not in out


def test_calls_are_counted_by_packing_whole_points() -> None:
    """Six-minute points take a call each, however little the total; short points share calls."""
    long = [(1.375, "fcfs-recompute", 360.0), (1.375, "lvf-rotate", 360.0), (1.75, "fcfs-recompute", 300.0),
            (1.75, "lvf-rotate", 300.0)]
    assert O.calls_needed(long) == 4  # the total with starts, 1,460 s, would say 3
    assert O.calls_needed([(1.0, "a", 300.0), (1.0, "b", 300.0)]) == 2  # 670 s with starts: not one call
    short = [(r, run, 60.0) for r in (4.0, 5.0) for run in ("a", "b")]
    assert O.calls_needed(short) == 1  # 4 x 60 + 2 starts = 310 s
    assert O.calls_needed([]) == 0


def test_runs_replace_each_rows_own_and_a_variant_reaches_the_gpu_command(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--runs: the same runs in every chosen row (a variant with its launcher flag in the GPU command);
    a run the simulator cannot run is a usage error before any search."""
    row = next(r for r in O.rows() if r.row == "1")
    both = dataclasses.replace(row, runs=("lvf-rotate", "lvf-rotate.missed"))
    cmd = O.gpu_command(both, (4.5,))
    assert cmd.startswith('RUNS="lvf-rotate lvf-rotate.missed" VARIANTS="missed=--lvf-missed-last" SHARE=0.25')
    assert "VARIANTS" not in O.gpu_command(row, (4.5,))
    for bad, says in (("lvf-rotate.nope", "the simulator knows the variants missed"), ("lvf", "POLICY-MODE")):
        with pytest.raises(SystemExit) as e:
            O.main(["--rows", "1", "--runs", bad, "--out", str(tmp_path)])
        assert e.value.code == 2 and says in capsys.readouterr().err
