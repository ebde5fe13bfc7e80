"""The two sides of the remote-attention exchange, for bench/remote_attention.py (section `exchange`).

Per decode step and per layer l (Llama-3-8B geometry: 32 layers, 32 q heads, 8 kv heads, head_dim 128,
bf16), on the sender's stream s and the executor's stream x:

    sender (GPU / process A)                          executor (GPU / process B)
    push q|k|v of bs rows -> B.qkv[l]  (raw copy)
    B.doorbell[l] = 1  ────────────────────────────>  wait doorbell[l] == 1; doorbell[l] = 0
                                                      o[l] = the q part of qkv[l]  (stands for attention)
                                                      push o[l] -> A.o[l]  (raw copy)
    wait done[l] == 1; done[l] = 0  <──────────────── A.done[l] = 1

Each consumer zeroes the flag it consumed (reset-after-consume; or, `lean`, its whole flag array once,
after its last wait of the step, as the engine does), so a step is the same operations with the same
values every time: it is captured once per batch size as a CUDA graph per side and replayed. Every
copy is pushed by the GPU that holds the data (a push is the fast direction). Per-layer slots are sized
for the largest batch, so one set of buffers (and one IPC exchange) serves every batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_ext.transport.cuda_signal import FlagArray, IpcMapping, export_tensor, peer_copy
from sglang_ext.transport.protocol import IpcHandle

BF16 = 2  # bytes per element


class Stuck(RuntimeError):
    """GPU work did not finish in time, and unblocking its flag waits did not free it either."""


@dataclass(frozen=True)
class Geometry:
    layers: int = 32
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    max_bs: int = 256

    @property
    def row_in(self) -> int:  # elements of one row sent: q, k and v
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def row_out(self) -> int:  # elements of one row of attention output
        return self.q_heads * self.head_dim

    def in_bytes(self, bs: int) -> int:
        return bs * self.row_in * BF16

    def out_bytes(self, bs: int) -> int:
        return bs * self.row_out * BF16


class Buffers:
    """One side's own memory: per-layer qkv and o slots (bf16) and one flag per layer (the executor's
    doorbells, or the sender's done flags)."""

    def __init__(self, geo: Geometry, device: int, seed: int) -> None:
        self.geo, self.device = geo, device
        dev = torch.device("cuda", device)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.qkv = torch.randn(geo.layers, geo.max_bs * geo.row_in, device=dev, generator=g).to(torch.bfloat16)
        self.o = torch.randn(geo.layers, geo.max_bs * geo.row_out, device=dev, generator=g).to(torch.bfloat16)
        self.flags = FlagArray.allocate(geo.layers, device)
        torch.cuda.synchronize(device)

    def remote(self) -> Remote:
        """These buffers as a peer GPU of the same process addresses them (peer access enabled)."""
        return Remote(self.qkv.data_ptr(), self.o.data_ptr(), self.flags, self.geo)

    def export(self) -> dict[str, str]:
        return {"qkv": export_tensor(self.qkv).to_bytes().hex(), "o": export_tensor(self.o).to_bytes().hex(),
                "flags": self.flags.export().to_bytes().hex()}


@dataclass
class Remote:
    """The other side's buffers as this side addresses them: peer pointers or IPC mappings."""

    qkv: int
    o: int
    flags: FlagArray
    geo: Geometry

    def qkv_at(self, layer: int) -> int:
        return self.qkv + layer * self.geo.max_bs * self.geo.row_in * BF16

    def o_at(self, layer: int) -> int:
        return self.o + layer * self.geo.max_bs * self.geo.row_out * BF16

    @classmethod
    def open(cls, exported: dict[str, str], device: int, geo: Geometry) -> tuple[Remote, list[IpcMapping]]:
        """Map another process's `Buffers.export()` on `device`."""
        maps = {k: IpcMapping(IpcHandle.from_bytes(bytes.fromhex(v)), device) for k, v in exported.items()}
        return cls(maps["qkv"].ptr, maps["o"].ptr, maps["flags"].flags(geo.layers), geo), list(maps.values())


class Sender:
    """The side whose model runs the layers: pushes q|k|v, rings the doorbell, waits for the output."""

    def __init__(self, own: Buffers, peer: Remote) -> None:
        self.own, self.peer, self.geo = own, peer, own.geo
        self.stream = torch.cuda.Stream(device=own.device)
        self.event = torch.cuda.Event()

    def step(self, bs: int, lean: bool = False) -> None:
        """Enqueue one decode step's exchange (eagerly, or into a graph being captured). `lean`: the
        completion flags are zeroed once, after the step's last wait (one memset), instead of after each
        wait, which takes a stream operation per layer off the sender's critical path -- the engine's
        scheme (sglang_ext/transport/gated.py says why it is safe)."""
        n, s, done = self.geo.in_bytes(bs), self.stream, self.own.flags
        last = self.geo.layers - 1
        with torch.cuda.device(self.own.device):
            for layer in range(self.geo.layers):
                peer_copy(self.peer.qkv_at(layer), self.own.qkv[layer].data_ptr(), n, s)
                self.peer.flags.write(s, layer, 1)
                done.wait(s, layer, 1)
                if not lean:
                    done.write(s, layer, 0)
                elif layer == last:
                    done.fill(s, 0)

    def data_only(self, bs: int) -> None:
        """The same q|k|v pushes with no signalling."""
        n = self.geo.in_bytes(bs)
        with torch.cuda.device(self.own.device):
            for layer in range(self.geo.layers):
                peer_copy(self.peer.qkv_at(layer), self.own.qkv[layer].data_ptr(), n, self.stream)

    def cpu_push(self, layer: int, bs: int) -> None:
        """CPU-driven: push one layer's q|k|v and block the host until it has landed."""
        peer_copy(self.peer.qkv_at(layer), self.own.qkv[layer].data_ptr(), self.geo.in_bytes(bs), self.stream)
        self.event.record(self.stream)
        self.event.synchronize()

    def refresh(self, bs: int, seed: int) -> None:
        """Fresh q|k|v for the rows in use and a poisoned output, so a check sees only this step's work."""
        g = torch.Generator(device=self.own.qkv.device).manual_seed(seed)
        n_in, n_out = bs * self.geo.row_in, bs * self.geo.row_out
        with torch.cuda.device(self.own.device), torch.cuda.stream(self.stream):
            fresh = torch.randn(self.geo.layers, n_in, device=self.own.qkv.device, generator=g)
            self.own.qkv[:, :n_in].copy_(fresh)
            self.own.o[:, :n_out].fill_(float("nan"))

    def check(self, bs: int) -> bool:
        """After a finished step: every layer's output is its q, bit for bit."""
        geo = self.geo
        self.stream.synchronize()
        q = self.own.qkv[:, : bs * geo.row_in].view(geo.layers, bs, -1, geo.head_dim)[:, :, : geo.q_heads]
        o = self.own.o[:, : bs * geo.row_out].view(geo.layers, bs, geo.q_heads, geo.head_dim)
        return bool(torch.equal(o, q))


class Executor:
    """The side that holds the KV: waits for the doorbell, computes (a copy here), pushes o back."""

    def __init__(self, own: Buffers, peer: Remote) -> None:
        self.own, self.peer, self.geo = own, peer, own.geo
        self.stream = torch.cuda.Stream(device=own.device)
        self.event = torch.cuda.Event()
        self._views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _compute(self, layer: int, bs: int) -> None:
        if bs not in self._views:  # cached: eager runs would pay the slicing on every layer (views allocate nothing)
            geo = self.geo
            q = self.own.qkv[:, : bs * geo.row_in].view(geo.layers, bs, -1, geo.head_dim)[:, :, : geo.q_heads]
            o = self.own.o[:, : bs * geo.row_out].view(geo.layers, bs, geo.q_heads, geo.head_dim)
            self._views[bs] = [(o[i], q[i]) for i in range(geo.layers)]
        dst, src = self._views[bs][layer]
        with torch.cuda.stream(self.stream):
            dst.copy_(src)

    def _push_out(self, layer: int, bs: int) -> None:
        peer_copy(self.peer.o_at(layer), self.own.o[layer].data_ptr(), self.geo.out_bytes(bs), self.stream)

    def step(self, bs: int, lean: bool = False) -> None:
        """`lean`: the doorbells are zeroed once, right after the last layer's wait (one memset), instead
        of after each wait, as the engine's GatedProgram does. The sender rings the next step's doorbells
        only after the last completion flag, raised after the memset, so none is lost."""
        x, bell = self.stream, self.own.flags
        last = self.geo.layers - 1
        with torch.cuda.device(self.own.device):
            for layer in range(self.geo.layers):
                bell.wait(x, layer, 1)
                if not lean:
                    bell.write(x, layer, 0)
                elif layer == last:
                    bell.fill(x, 0)
                self._compute(layer, bs)
                self._push_out(layer, bs)
                self.peer.flags.write(x, layer, 1)

    def data_only(self, bs: int) -> None:
        with torch.cuda.device(self.own.device):
            for layer in range(self.geo.layers):
                self._compute(layer, bs)
                self._push_out(layer, bs)

    def cpu_layer(self, layer: int, bs: int) -> None:
        """CPU-driven: compute and push one layer, block the host until the output has landed."""
        with torch.cuda.device(self.own.device):
            self._compute(layer, bs)
            self._push_out(layer, bs)
            self.event.record(self.stream)
            self.event.synchronize()


# ---- graphs, timing, waiting ------------------------------------------------------------------------
def capture(stream: torch.cuda.Stream, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Capture fn's work on `stream` (its own device) as one graph."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(stream.device), torch.cuda.graph(g, stream=stream):
        fn()
    return g


def replay(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        graph.replay()


def mark(stream: torch.cuda.Stream) -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record(stream)
    return e


def time_stream(enqueue: Callable[[], None], stream: torch.cuda.Stream, steps: int, warmup: int,
                repeats: int) -> list[float]:
    """Milliseconds per call of `enqueue` (work with no cross-stream waits) on `stream`, one figure per
    repeat: events around `steps` calls issued back to back after `warmup` calls."""
    out = []
    for _ in range(repeats):
        for _ in range(warmup):
            enqueue()
        e0 = mark(stream)
        for _ in range(steps):
            enqueue()
        e1 = mark(stream)
        e1.synchronize()
        out.append(e0.elapsed_time(e1) / steps)
    return out


def wait_events(events: list[torch.cuda.Event], timeout_s: float) -> bool:
    """Poll until every event has completed (True) or the timeout passes (False). Never blocks in the
    driver, so a flag wait that is never satisfied cannot hang the benchmark."""
    deadline = time.monotonic() + timeout_s
    while not all(e.query() for e in events):
        if time.monotonic() > deadline:
            return False
        time.sleep(20e-6)
    return True


def unblock(flag_sets: list[tuple[FlagArray, torch.cuda.Stream]], streams: list[torch.cuda.Stream],
            timeout_s: float = 5.0) -> None:
    """After a timeout: set every flag to 1 (on side streams, so they are not queued behind the stuck
    waits) until the stuck streams drain, then zero the flags again. Raises Stuck if they never drain."""
    ends = [mark(s) for s in streams]
    deadline = time.monotonic() + timeout_s
    while not all(e.query() for e in ends):
        # Each fill lets a stuck side through one round of waits: refill often, a run has many steps.
        for flags, rescue in flag_sets:
            flags.fill(rescue, 1)
        time.sleep(0.001)
        if time.monotonic() > deadline:
            raise Stuck("GPU streams still blocked after their flags were forced to 1")
    for flags, rescue in flag_sets:
        flags.fill(rescue, 0)
        rescue.synchronize()
