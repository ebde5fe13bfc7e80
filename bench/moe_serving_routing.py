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
    p.add_argument("--prompt-len", default="64,256",
                   help="prompt lengths drawn uniformly from MIN,MAX (the Qwen3 panel's prompts were ~5.7K tokens)")
    p.add_argument("--vocab", default="100,2000",
                   help="prompt token ids drawn from LOW,HIGH (bench/serving.py's client draws 100..32000)")
    p.add_argument("--routing", choices=("off", "uniform"), default="off",
                   help="the worker's --moe-routing-simulation (uniform: what this count should then match)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu",
                   help="cuda: the whole preset on the GPU (eager, no CUDA graphs: the count syncs per layer)")
    p.add_argument("--moe-inter", type=int, default=None,
                   help="narrower experts (moe_intermediate_size), so all of the preset's layers fit this machine")
    a = p.parse_args(argv)
    try:
        lo_len, hi_len = (int(x) for x in a.prompt_len.split(","))
        lo_id, hi_id = (int(x) for x in a.vocab.split(","))
    except ValueError:
        p.error("--prompt-len and --vocab take two integers, MIN,MAX")
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
        w = Worker(ServerArgs(model_path=str(model), load_format="dummy", device=a.device, dtype=a.dtype, page_size=16,
                              max_total_tokens=a.rows * (hi_len + a.new + 64), skip_tokenizer_init=True,
                              moe_routing_simulation=a.routing, disable_cuda_graph=True, disable_overlap_schedule=True))
        calls: list[tuple[int, int]] = []  # (tokens, distinct experts) per sparse layer and forward

        def hook(_m: Any, args: tuple[Any, ...]) -> None:
            calls.append((int(args[2].shape[0]), int(torch.unique(args[2]).numel())))

        for m in w.runner.model.modules():
            if isinstance(m, Experts):
                m.register_forward_pre_hook(hook)
        rng = random.Random(0)
        sp = SamplingParams(max_new_tokens=a.new, temperature=0.0, ignore_eos=True)
        prompts = [[rng.randrange(lo_id, hi_id) for _ in range(rng.randint(lo_len, hi_len))] for _ in range(a.rows)]
        inbox: list[Any] = [GenerateReq(rid=f"r{i}", input_ids=ids, sampling_params=sp)
                            for i, ids in enumerate(prompts)]
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
    n_exp, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    # decode-only forwards: at most one token a row (a forward with a prefill chunk has more)
    decode = [(n, h) for n, h in calls if 2 <= n <= a.rows]
    if not decode:
        print("no decode-only forward ran (raise --new)", file=sys.stderr)
        return 1
    from bench.sim.geometry import expected_experts_hit  # the expectation the simulator prices

    share = [h / expected_experts_hit(n_exp, k, n) for n, h in decode]
    full = [h for n, h in decode if n == a.rows]
    uniform = expected_experts_hit(n_exp, k, a.rows)
    last = [ids[-1] for ids in out.values()]
    tokens = [t for ids in out.values() for t in ids]
    narrow = f", experts {a.moe_inter} wide" if a.moe_inter else ""
    at_full = (f"; with all {a.rows} rows {statistics.mean(full):.1f} distinct experts per layer against "
               f"{uniform:.1f} uniform" if full else "")
    sim = ", routing simulated: uniform" if a.routing == "uniform" else ""
    print(f"{a.preset} routing{sim}, {a.layers} layers{narrow}, {a.rows} rows, prompts {a.prompt_len} tokens, "
          f"{a.dtype}, {a.device}, dummy weights, greedy: {len(decode)} decode forwards x sparse layers; "
          f"distinct experts per layer {100 * statistics.mean(share):.0f} % of uniform routing's "
          f"(min {100 * min(share):.0f} %){at_full}; {len(set(tokens))} distinct tokens of {len(tokens)} "
          f"generated, {len(set(last))} distinct among the rows' last tokens; {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
