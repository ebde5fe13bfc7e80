"""Distinct experts per decode forward when a dummy-weight MoE serves greedy requests, against the
uniform-routing expectation the simulator prices (E x (1 - (1 - k/E)^rows)).

    python bench/moe_serving_routing.py --preset qwen3-30b-a3b --layers 8 --rows 12 --new 48
    python bench/moe_serving_routing.py --layers 48 --moe-inter 64 --rows 12 --new 24   # every layer, ~8 GB

Why: the offline bench feeds random tokens to every decode row, so its experts hit equal the uniform
estimate; in serving, a dummy-weight model's greedy output repeats one token per request, which could
concentrate the routing and make serving's decode cheaper than the offline rows say. This runs the real
worker in process (CPU, bf16) on the preset's routing geometry with fewer layers and counts, per sparse
layer and decode forward, the experts its router picked.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # executed as ``python bench/moe_serving_routing.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8, help="the preset's geometry with this many layers")
    p.add_argument("--rows", type=int, default=12, help="requests decoding together")
    p.add_argument("--new", type=int, default=48, help="tokens each request generates")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--moe-inter", type=int, default=None,
                   help="narrower experts (moe_intermediate_size), so all of the preset's layers fit this machine")
    a = p.parse_args(argv)
    import torch

    from sglang_ext.configs import preset_dir
    from sglang_ext.messages import BatchOut, GenerateReq
    from sglang_ext.models.moe import Experts
    from sglang_ext.sampling.params import SamplingParams
    from sglang_ext.server_args import ServerArgs
    from sglang_ext.worker.worker import Worker

    try:
        src = preset_dir(a.preset)
    except ValueError as e:
        p.error(str(e))  # exits 2 with the usage line and the known presets
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / a.preset
        shutil.copytree(src, model)
        cfg = json.loads((model / "config.json").read_text())
        cfg["num_hidden_layers"] = a.layers
        if a.moe_inter:
            cfg["moe_intermediate_size"] = a.moe_inter
        (model / "config.json").write_text(json.dumps(cfg))
        torch.manual_seed(0)
        w = Worker(ServerArgs(model_path=str(model), load_format="dummy", device="cpu", dtype=a.dtype, page_size=16,
                              max_total_tokens=a.rows * 512, skip_tokenizer_init=True))
        calls: list[tuple[int, int]] = []  # (tokens, distinct experts) per sparse layer and forward

        def hook(_m: Any, args: tuple[Any, ...]) -> None:
            calls.append((int(args[2].shape[0]), int(torch.unique(args[2]).numel())))

        for m in w.runner.model.modules():
            if isinstance(m, Experts):
                m.register_forward_pre_hook(hook)
        rng = random.Random(0)
        sp = SamplingParams(max_new_tokens=a.new, temperature=0.0, ignore_eos=True)
        inbox = [GenerateReq(rid=f"r{i}", input_ids=[rng.randrange(100, 2000) for _ in range(rng.randrange(64, 256))],
                             sampling_params=sp) for i in range(a.rows)]
        out: dict[str, list[int]] = {}
        t0 = time.perf_counter()
        while True:
            for o in w.step(inbox):
                if isinstance(o, BatchOut):
                    for t in o.outs:
                        out.setdefault(t.rid, []).extend(t.token_ids)
            inbox = []
            if not w.has_work():
                break
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    decode = [h for n, h in calls if n == a.rows]
    uniform = e * (1 - (1 - k / e) ** a.rows)
    tokens = [t for ids in out.values() for t in ids]
    narrow = f", experts {a.moe_inter} wide" if a.moe_inter else ""
    print(f"{a.preset} routing, {a.layers} layers{narrow}, {a.rows} rows, {a.dtype}, dummy weights, greedy: "
          f"{len(decode)} decode forwards x sparse layers; distinct experts per layer mean "
          f"{statistics.mean(decode):.1f} (min {min(decode)}, max {max(decode)}) against {uniform:.1f} uniform "
          f"({100 * statistics.mean(decode) / uniform:.0f} %); {len(set(tokens))} distinct tokens of {len(tokens)} "
          f"generated; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
