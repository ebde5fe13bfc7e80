"""bench/gpu_session.sh's knee steps, run on the CPU with stand-ins for `python3` and `nvidia-smi`: what each
knee search is asked to do, where its files land, and the call's time shared out one search after another."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Answers `python3 -m pip ...` with success; for bench/goodput_knee.py writes its argv as knee.json under --out
# (and takes 1 s, so the next search's budget is visibly smaller); for step_profile.py prints a line.
STUB_PYTHON = """#!/usr/bin/env bash
case " $* " in
  *" -m pip "*) exit 0 ;;
  *bench/goodput_knee.py*)
    out=""; prev=""; for a in "$@"; do [ "$prev" = "--out" ] && out=$a; prev=$a; done
    mkdir -p "$out"; printf '%s\\n' "$@" > "$out/argv.txt"; echo '{}' > "$out/knee.json"; sleep 1
    echo "stub knee search into $out" ;;
  *bench/step_profile.py*) echo "stub steps" ;;
  *) echo "unexpected python3 call: $*" >&2; exit 3 ;;
esac
"""


def _stub(bin_dir: Path, name: str, text: str) -> None:
    p = bin_dir / name
    p.write_text(text)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


Runner = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def session(tmp_path: Path) -> tuple[Runner, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "python3", STUB_PYTHON)
    _stub(bin_dir, "nvidia-smi", "#!/usr/bin/env bash\necho 'stub GPU'\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("flashinfer_python-0-py3-none-any.whl", "pyzmq-0-py3-none-any.whl"):
        (wheels / name).write_bytes(b"")
    out = tmp_path / "out"

    def run(steps: str, **env: str) -> subprocess.CompletedProcess[str]:
        full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "WHEELS": str(wheels),
                **env}
        return subprocess.run(["bash", "bench/gpu_session.sh", *steps.split()], cwd=REPO, env=full,
                              capture_output=True, text=True, timeout=60)

    return run, out


def _argv(folder: Path) -> dict[str, list[str]]:
    """The stub's record of one search's flags: flag -> the values that follow it."""
    flags: dict[str, list[str]] = {}
    key = ""
    for a in (folder / "argv.txt").read_text().splitlines():
        if a.startswith("--"):
            key = a
            flags.setdefault(key, [])
        elif key:
            flags[key].append(a)
    return flags


def test_kneeseq_runs_one_search_per_item_each_with_what_the_call_has_left(session: tuple[Runner, Path]) -> None:
    run, out = session
    r = run("kneeseq", KNEE_SEQ="fcfs-recompute:2.375 lvf-rotate:3.1875,3.375", KNEE_END_S="400",
            RESUME="bench/results/never-used", VARIANTS="missed=--lvf-missed-last", SERVER_ARGS="--x=1 --y=2")
    assert r.returncode == 0, r.stderr
    first, second = out / "knee-fcfs-recompute-2.375", out / "knee-lvf-rotate-3.1875-3.375"
    a, b = _argv(first), _argv(second)
    assert a["--runs"] == ["fcfs-recompute"] and a["--grid"] == ["2.375"]
    assert b["--runs"] == ["lvf-rotate"] and b["--grid"] == ["3.1875", "3.375"]
    # the second search gets the call's deadline less what the first took (>= the stub's 1 s)
    assert int(b["--budget-s"][0]) < int(a["--budget-s"][0]) <= 400
    for flags in (a, b):
        assert "--resume" not in flags  # a resumed search must keep its grid: never with a sequence
        assert flags["--variant"] == ["missed=--lvf-missed-last"]
        assert flags["--server-arg=--x=1"] == [] and flags["--server-arg=--y=2"] == []
    for folder in (first, second):  # each search's folder, log and archive (the archive holds the folder)
        assert (folder / "steps.txt").read_text().strip() == "stub steps"
        assert "stub knee search" in Path(f"{folder}.log").read_text()
        with tarfile.open(f"{folder}.tgz") as t:
            assert f"{folder.name}/knee.json" in t.getnames()


def test_kneeseq_starts_no_search_the_call_has_no_time_for(session: tuple[Runner, Path]) -> None:
    run, out = session
    r = run("kneeseq", KNEE_SEQ="fcfs-recompute:2.5", KNEE_END_S="10")
    assert r.returncode == 0, r.stderr
    assert "knee search knee-fcfs-recompute-2.5: not started" in r.stdout
    assert not (out / "knee-fcfs-recompute-2.5").exists()


def test_knee_step_keeps_its_folder_names_and_flags(session: tuple[Runner, Path]) -> None:
    run, out = session
    r = run("knee", RUNS="fcfs-recompute lvf-rotate", GRID="5 5.5", KNEE_END_S="300", RESUME="bench/results/x",
            EXTEND="0", EST_START_S="15")
    assert r.returncode == 0, r.stderr
    flags = _argv(out / "knee")
    assert flags["--runs"] == ["fcfs-recompute", "lvf-rotate"] and flags["--grid"] == ["5", "5.5"]
    assert flags["--resume"] == ["bench/results/x"] and flags["--extend"] == ["0"]
    assert flags["--est-start-s"] == ["15"]
    assert json.loads((out / "knee" / "knee.json").read_text()) == {}
    assert (out / "knee.tgz").is_file() and (out / "knee.log").is_file()


def test_kneeseq_names_an_item_it_cannot_read_and_runs_the_rest(session: tuple[Runner, Path]) -> None:
    run, out = session
    r = run("kneeseq", KNEE_SEQ="lvf-rotate fcfs-recompute:2.5 lvf-rotate:3.1875;rm", KNEE_END_S="300")
    assert r.returncode == 0, r.stderr
    assert "kneeseq: 'lvf-rotate' is not RUN:RATE[,RATE...]" in r.stderr
    assert "kneeseq: 'lvf-rotate:3.1875;rm' is not RUN:RATE[,RATE...]" in r.stderr
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["knee-fcfs-recompute-2.5"]
