"""The simulator's clock: how long a forward, a KV copy or a remote-attention exchange takes on one GPU.

Rates come from a calibration file fitted to measurements (`python -m bench.sim.fit`); the model's shape
comes from its Geometry, so one GPU's file prices any model:

    decode step = max(weight bytes read / weights_GBps, rows x FLOPs per row / decode gemm_TFLOPs)
                  + KV bytes read / kv_GBps + rows x row_us + step_us
    an MoE adds   sparse layers x experts hit x expert bytes / moe.expert_GBps (in the max's read side)
                  + sparse layers x experts of the model x moe.layer_expert_us   (per-expert work of routing
                    and alignment, and the grouped GEMMs' per-expert blocks: fixed per step; in prefill too)
    prefill     = max(weight bytes / weights_GBps, tokens' GEMM FLOPs / prefill gemm_TFLOPs)
                  + causal attention FLOPs / attention_TFLOPs + step_us (+ an MoE's fixed term)
    MoE prefill (with `moe_prefill`): the dense part as above on the non-expert FLOPs, and the experts
                  max(the decode form's expert read + fixed term,
                      sparse layers x experts hit x (expert bytes / moe_prefill.expert_GBps
                                                     + moe_prefill.layer_expert_us)
                      + expert GEMM FLOPs / moe_prefill.gemm_TFLOPs)
                  from blend_to_tokens (1K) tokens up; the decode form up to blend_from_tokens (256);
                  linear in tokens between (unmeasured there); its attention at moe_prefill.attention_TFLOPs
                  where the file has one (fitted to prefills of many lengths: the H100's Qwen3), else at the
                  dense prefill's rate
    mixed batch = the prefill form over every token, plus the decode rows' KV read and per-row cost
    a step with a prefill chunk also pays the host time of a step the loop cannot overlap (`plain_host_s`)

The `moe` rates are fitted to MoE decode steps (bench/sim/fit.py); a calibration file without a `moe`
section (written before any MoE run existed) prices experts at the dense weights' rate with no MoE term,
which is what `python -m bench.sim.validate` reports as "dense rates". The `moe_prefill` rates are fitted to
MoE prefill forwards (1-8K tokens); a file without them prices an MoE prefill with the dense prefill rates
on the active FLOPs (under-predicted by 16-72 % on the measured rows).
A quantity the calibration has no measurement for is null there with a reason; asking for it raises
`Uncalibrated` naming the quantity and the reason, never a guess.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from bench.sim.geometry import Geometry

CALIBRATION_DIR: Final = Path(__file__).resolve().parent / "calibration"
DEFAULT_CALIBRATION: Final = CALIBRATION_DIR / "h200.json"
GiB: Final = 2**30


class Uncalibrated(LookupError):
    """A cost the calibration file has no measurement for."""


@dataclass(frozen=True)
class Calibration:
    """One GPU's fitted rates (see bench/sim/fit.py for where each comes from). Sections are the JSON's;
    a value may be None, with `missing[<section>.<key>]` saying why."""

    gpu: str
    decode: dict[str, float | None]
    prefill: dict[str, float | None]
    host_link: dict[str, float | None]
    remote_exchange: dict[str, dict[str, float | None]]
    executor_host: dict[str, Any]
    moe: dict[str, float | None] | None = None  # None: a file without the section (dense rates for experts)
    moe_prefill: dict[str, float | None] | None = None  # None: no MoE prefill term (dense prefill rates)
    missing: dict[str, str] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        for key in ("gpu", "decode", "prefill", "host_link", "remote_exchange", "executor_host"):
            if key not in d:
                raise ValueError(f"calibration: missing section {key!r}")
        return cls(gpu=d["gpu"], decode=d["decode"], prefill=d["prefill"], host_link=d["host_link"],
                   remote_exchange=d["remote_exchange"], executor_host=d["executor_host"], moe=d.get("moe"),
                   moe_prefill=d.get("moe_prefill"), missing=d.get("missing", {}), runs=d.get("runs", []), raw=d)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Calibration:
        p = Path(path) if path is not None else DEFAULT_CALIBRATION
        return cls.from_dict(json.loads(p.read_text()))

    def get(self, section: str, key: str) -> float:
        sec: Any = getattr(self, section)
        value = sec.get(key) if isinstance(sec, dict) else None
        if value is None:
            why = self.missing.get(f"{section}.{key}", "not in the calibration file")
            raise Uncalibrated(f"{section}.{key} has no measurement on {self.gpu}: {why}")
        return float(value)


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward / copy / exchange for one model (`geo`) on one calibrated GPU (`cal`)."""

    cal: Calibration
    geo: Geometry
    # The engine before 2026-12-07 (commit 2e5bb7a) routed a decode CUDA graph's padding rows to experts
    # like real rows: with these capture sizes, a decode step's experts are priced at the padded size's
    # (12 rows in the graph of 16 read 16 rows' experts). None: the engine since, padding reads no expert.
    graph_sizes: tuple[int, ...] | None = None

    @classmethod
    def load(cls, calibration: str | Path | None = None, model: str = "llama-3-8b",
             graph_sizes: Sequence[int] | None = None) -> CostModel:
        return cls(Calibration.load(calibration), Geometry.preset(model),
                   None if graph_sizes is None else tuple(sorted(graph_sizes)))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.geo.kv_bytes_per_token

    # -- compute ---------------------------------------------------------------------------------
    def _dense_s(self, rows: float, flops: float, gemm_TFLOPs: float, experts_hit: float | None) -> float:
        g = self.geo
        dense_rate = self.cal.get("decode", "weights_GBps") * 1e9
        if g.is_moe and self.cal.moe is not None:
            expert_bytes = g.weight_read_bytes(rows, experts_hit) - g.dense_weight_bytes
            read = g.dense_weight_bytes / dense_rate + expert_bytes / (self.cal.get("moe", "expert_GBps") * 1e9)
        else:
            read = g.weight_read_bytes(rows, experts_hit) / dense_rate
        return max(read, flops / (gemm_TFLOPs * 1e12))

    def moe_overhead_s(self) -> float:
        """Per forward, an MoE's fixed work: per sparse layer, a cost per expert of the model (the routing
        and alignment scan every expert; the grouped GEMMs launch blocks per expert). Fitted, it is what
        makes Qwen3-30B-A3B's bs-1 step (128 experts x 48 layers) twice its bytes' time while Mixtral's
        (8 x 32) is not. 0 for a dense model or a calibration without the `moe` section."""
        g = self.geo
        if not g.is_moe or self.cal.moe is None:
            return 0.0
        return g.sparse_layers * g.num_experts * self.cal.get("moe", "layer_expert_us") * 1e-6

    def decode_s(self, rows: int, kv_tokens: int, experts_hit: float | None = None) -> float:
        """One decode step over `rows` requests reading `kv_tokens` KV tokens in all (sum of their
        contexts); `experts_hit` per sparse layer if measured, else the uniform-routing expectation."""
        if rows <= 0:
            return 0.0
        if experts_hit is None and self.graph_sizes and self.geo.is_moe:
            padded = next((s for s in self.graph_sizes if s >= rows), rows)  # past the largest: eager, unpadded
            experts_hit = self.geo.experts_hit(padded)
        dense = self._dense_s(rows, rows * self.geo.flops_per_row, self.cal.get("decode", "gemm_TFLOPs"), experts_hit)
        return (dense + self.moe_overhead_s()
                + kv_tokens * self.geo.kv_bytes_per_token / (self.cal.get("decode", "kv_GBps") * 1e9)
                + rows * self.cal.get("decode", "row_us") * 1e-6 + self.cal.get("decode", "step_us") * 1e-6)

    def prefill_s(self, chunks: Sequence[tuple[int, int]], decode_rows: int = 0, decode_kv_tokens: int = 0) -> float:
        """One forward over prefill `chunks` ((new tokens, position after them) per request), with
        `decode_rows` decode rows riding along (chunked prefill's mixed batches)."""
        if not chunks:
            return self.decode_s(decode_rows, decode_kv_tokens)
        g = self.geo
        tokens = sum(n for n, _ in chunks) + decode_rows
        flops = 2.0 * g.layer_params * tokens + 2.0 * g.lm_head_params * (len(chunks) + decode_rows)
        attn_flops = sum(g.attention_flops(n, end) for n, end in chunks)
        attn = attn_flops / (self.attention_TFLOPs() * 1e12)
        if self.has_moe_prefill():
            dense_rate = self.cal.get("decode", "weights_GBps") * 1e9
            rest = flops - g.expert_flops(tokens)
            t = (max(g.dense_weight_bytes / dense_rate, rest / (self.cal.get("prefill", "gemm_TFLOPs") * 1e12))
                 + self.moe_prefill_experts_s(tokens))
        else:
            t = self._dense_s(tokens, flops, self.cal.get("prefill", "gemm_TFLOPs"), None) + self.moe_overhead_s()
        t += attn + self.cal.get("decode", "step_us") * 1e-6
        if decode_rows:
            t += (decode_kv_tokens * g.kv_bytes_per_token / (self.cal.get("decode", "kv_GBps") * 1e9)
                  + decode_rows * self.cal.get("decode", "row_us") * 1e-6)
        return t

    def attention_TFLOPs(self) -> float:
        """The prefill attention's rate: an MoE's own (`moe_prefill.attention_TFLOPs`, fitted where its
        prefills span enough lengths, fit.MOE_ATTENTION_MIN_LENGTHS), else the dense model's."""
        own = (self.cal.moe_prefill or {}).get("attention_TFLOPs") if self.has_moe_prefill() else None
        return float(own) if own is not None else self.cal.get("prefill", "attention_TFLOPs")

    def has_moe_prefill(self) -> bool:
        """An MoE priced with the fitted `moe_prefill` rates (and the `moe` ones they fall back to)."""
        mp, m = self.cal.moe_prefill, self.cal.moe
        return (self.geo.is_moe and mp is not None and m is not None
                and all(mp.get(k) is not None for k in ("expert_GBps", "layer_expert_us", "gemm_TFLOPs",
                                                         "blend_from_tokens", "blend_to_tokens"))
                and all(v is not None for v in m.values()))

    def moe_prefill_experts_s(self, tokens: int) -> float:
        """The routed experts of one forward over `tokens` tokens (a prefill, or a mixed batch). Prefill form,
        fitted to prefills of `blend_to_tokens` (1K) to 8K tokens: every expert hit is read once per sparse
        layer and pays a fixed cost (its grouped-GEMM tiles, alignment), and the expert FLOPs run at the
        grouped GEMM's rate (never less than the decode form). Decode form, fitted to decode batches up to
        `blend_from_tokens` (256) rows: the experts hit read at moe.expert_GBps plus the per-model-expert
        term. The same kernels run both (their block sizes keyed by the token count), and nothing between
        256 and 1K tokens is measured: there the two are blended linearly in tokens, so a short chunk is
        priced like a decode batch of as many rows, not by the prefill form extrapolated down."""
        g = self.geo
        hit = g.experts_hit(tokens)
        decode = (g.sparse_layers * hit * g.expert_bytes / (self.cal.get("moe", "expert_GBps") * 1e9)
                  + self.moe_overhead_s())
        per_expert = (g.expert_bytes / (self.cal.get("moe_prefill", "expert_GBps") * 1e9)
                      + self.cal.get("moe_prefill", "layer_expert_us") * 1e-6)
        prefill = max(decode, g.sparse_layers * hit * per_expert
                      + g.expert_flops(tokens) / (self.cal.get("moe_prefill", "gemm_TFLOPs") * 1e12))
        lo, hi = self.cal.get("moe_prefill", "blend_from_tokens"), self.cal.get("moe_prefill", "blend_to_tokens")
        w = min(1.0, max(0.0, (tokens - lo) / (hi - lo))) if hi > lo else float(tokens >= hi)
        return (1.0 - w) * decode + w * prefill

    def forward_s(self, extend_lens: Sequence[int], seq_lens: Sequence[int], host: bool = False) -> float:
        """A scheduler batch: rows extending by 1 are decode rows, longer ones prefill chunks. `host`: add
        the unoverlapped host time to a batch with a prefill chunk (the engine's loop overlaps only decode
        steps with the previous forward; a calibration without the `loop` rows raises Uncalibrated)."""
        rows = kv = 0
        chunks: list[tuple[int, int]] = []
        for n, end in zip(extend_lens, seq_lens, strict=True):
            if n == 1:
                rows, kv = rows + 1, kv + end
            else:
                chunks.append((n, end))
        t = self.prefill_s(chunks, rows, kv)
        return t + self.plain_host_s(rows + len(chunks)) if host and chunks else t

    def plain_host_s(self, rows: int) -> float:
        """Host time of a step the loop does not overlap with the previous forward (the engine overlaps
        decode steps only): scheduling, building and landing a batch of `rows` rows while the GPU idles,
        from bench/offline.py's plain-loop rows (`loop` in the calibration)."""
        loop = self.cal.raw.get("loop") or {}
        base, per_row = loop.get("plain_host_us"), loop.get("plain_host_row_us")
        if base is None or per_row is None:
            raise Uncalibrated(f"loop.plain_host_us has no measurement on {self.cal.gpu}: "
                               f"{self.cal.missing.get('loop.plain_host_us', 'not in the calibration file')}")
        return (float(base) + float(per_row) * rows) * 1e-6

    # -- host link -------------------------------------------------------------------------------
    def copy_s(self, nbytes: float, direction: str, duplex: bool = False) -> float:
        """A KV copy over the host link: `direction` "out" (device to host) or "in"; `duplex` when the
        other direction is copying at the same time (each then gets half the measured duplex rate)."""
        if direction not in ("out", "in"):
            raise ValueError(f"direction must be 'out' or 'in', not {direction!r}")
        if duplex:
            return nbytes / (self.cal.get("host_link", "duplex_GBps") * 1e9 / 2)
        return nbytes / (self.cal.get("host_link", "d2h_GBps" if direction == "out" else "h2d_GBps") * 1e9)

    # -- remote attention ------------------------------------------------------------------------
    def exchange_s(self, remote_rows: int, variant: str = "lean") -> float:
        """Per step, the signalled exchange of `remote_rows` rows' q|k|v and o for every layer."""
        ex = self.cal.remote_exchange.get(variant)
        if ex is None:
            raise ValueError(f"exchange variant must be one of {sorted(self.cal.remote_exchange)}, not {variant!r}")
        base, per_row = ex.get("base_us"), ex.get("per_row_us")
        if base is None or per_row is None:
            raise Uncalibrated(f"remote_exchange.{variant}: "
                               f"{self.cal.missing.get(f'remote_exchange.{variant}', 'no measurement')}")
        return self.geo.layers * (base + per_row * remote_rows) * 1e-6 if remote_rows else 0.0

    def remote_decode_s(self, rows: int, local_kv_tokens: int, remote_rows: int, variant: str = "lean") -> float:
        """A sender's decode step with `remote_rows` of its `rows` attended on another GPU: the dense
        work of all rows, the local rows' KV, and the exchange, the executor's attention overlapping."""
        return self.decode_s(rows, local_kv_tokens) + self.exchange_s(remote_rows, variant)

    def host_increase(self, guest_kv_gib: float, executor_sms: int | None = None) -> float:
        """Fractional slowdown of the executor host's own decode step while it serves a guest holding
        `guest_kv_gib` of KV: uncapped (None or 0) per GiB held; capped at a measured SM count flat."""
        h = self.cal.executor_host
        if not executor_sms:
            slope = h.get("uncapped_increase_per_guest_gib")
            if slope is None:
                raise Uncalibrated(f"executor_host uncapped: {self.cal.missing.get('executor_host.uncapped', '')}")
            return float(slope) * guest_kv_gib
        capped: dict[str, float] = h.get("capped_increase") or {}
        if str(executor_sms) not in capped:
            raise Uncalibrated(f"executor_host: no measurement with executor_max_sms={executor_sms} on {self.cal.gpu} "
                               f"(measured: {sorted(int(k) for k in capped)})")
        return float(capped[str(executor_sms)])

    def describe(self) -> dict[str, Any]:
        """What a report records about the clock it ran on."""
        return {"gpu": self.cal.gpu, "model": self.geo.name, "decode": self.cal.decode, "prefill": self.cal.prefill,
                "host_link": self.cal.host_link, "kv_bytes_per_token": self.geo.kv_bytes_per_token,
                "weight_bytes": self.geo.dense_weight_bytes}
