"""bench/structured.py's logic runs on CPU (--smoke): every point is measured (drained and overlapped
loops) and written out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.structured import main, synthetic_vocab


def test_smoke(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    main(["--smoke", "--batch-sizes", "2", "--steps", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [(p["bs"], p["constrained_rows"]) for p in res["points"]] == [(2, 0), (2, 1), (2, 2)]
    assert all(p["step_ms"] > 0 for p in res["points"]) and "fill_ms" in res["points"][2]
    # the overlap loop's step (masks filled while the next forward runs) beside the drained one
    assert all(p["overlap_step_ms"] > 0 and "overlap_overhead" in p for p in res["points"])
    assert "overlap_fill_ms" in res["points"][2] and "overlap_fill_ms" not in res["points"][0]


def test_synthetic_vocab_is_distinct_and_deterministic() -> None:
    v = synthetic_vocab(3000)
    assert len(v) == len(set(v)) == 3000 and v == synthetic_vocab(3000)


def test_tekken_vocab_reads_json_and_wheel(tmp_path: Path) -> None:
    import base64
    import zipfile

    from bench.structured import tekken_vocab

    toks = [b"a", b" the", b'":', "é".encode()]
    doc = json.dumps({"vocab": [{"rank": i, "token_bytes": base64.b64encode(t).decode()} for i, t in enumerate(toks)]})
    (tmp_path / "t.json").write_text(doc)
    with zipfile.ZipFile(tmp_path / "m.whl", "w") as z:
        z.writestr("mistral_common/data/tekken_240911.json", doc)
    assert tekken_vocab(str(tmp_path / "t.json"), 3) == toks[:3]
    assert tekken_vocab(str(tmp_path / "m.whl"), 4) == toks
