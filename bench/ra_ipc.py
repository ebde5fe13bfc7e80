"""The exchange between two processes on one GPU (bench/remote_attention.py, section `exchange`, variant c).

This process is the sender; a child started with subprocess is the executor. Each maps the other's
buffers with CUDA IPC (handles as hex inside JSON lines over the child's stdin/stdout: no pickle, no
multiprocessing); control messages are those JSON lines, and the CPU-driven variant's per-layer hand-offs
are single bytes on the same pipes. The child moves its stdout away from fd 1 first, so a stray print
cannot corrupt the protocol.

    python bench/ra_ipc.py --child --device 0 --layers 32 --max-bs 256    (started by the parent)
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.ra_exchange import (
    Buffers,
    Executor,
    Geometry,
    Remote,
    Sender,
    Stuck,
    capture,
    mark,
    replay,
    time_stream,
    wait_events,
)

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TOKEN = b"t"


class Link:
    """JSON lines and one-byte tokens over a pair of pipe file descriptors, every read with a timeout."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd, self.buf = rfd, wfd, bytearray()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view):]

    def _fill(self, deadline: float) -> None:
        ready, _, _ = select.select([self.rfd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError("no message from the other process in time")
        data = os.read(self.rfd, 1 << 16)
        if not data:
            raise EOFError("the other process closed its pipe")
        self.buf += data

    def send(self, msg: dict[str, Any]) -> None:
        self._write(json.dumps(msg).encode() + b"\n")

    def recv(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            self._fill(deadline)
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"executor process: {msg['error']}")
        return msg

    def send_token(self) -> None:
        os.write(self.wfd, TOKEN)

    def recv_token(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.buf:
            self._fill(deadline)
        if self.buf[:1] != TOKEN:
            raise RuntimeError(f"expected a hand-off token, got {bytes(self.buf[:80])!r}")
        del self.buf[:1]


# ---- parent (sender) --------------------------------------------------------------------------------
class ExecutorProcess:
    """The child executor, driven from the sender's process."""

    def __init__(self, geo: Geometry, device: int, timeout: float) -> None:
        self.geo, self.timeout = geo, timeout
        env = {**os.environ, **NO_MULTICAST}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--device", str(device),
               "--layers", str(geo.layers), "--max-bs", str(geo.max_bs), "--timeout", str(timeout)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.link = Link(self.proc.stdout.fileno(), self.proc.stdin.fileno())
        try:
            self.exported = self.link.recv(timeout=90)["buffers"]  # torch import + CUDA start in the child
        except BaseException:
            self.proc.kill()  # our own child, by handle
            self.proc.wait()
            raise

    def attach(self, own: Buffers) -> None:
        self.link.send({"op": "attach", "buffers": own.export()})
        self.link.recv(self.timeout)

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        self.link.send({"op": op, **kw})
        return self.link.recv(self.timeout)

    def poll(self, timeout: float) -> dict[str, Any] | str | None:
        """The child's next message, its error as a string, or None if it says nothing in time."""
        try:
            return self.link.recv(timeout)
        except TimeoutError:
            return None
        except (RuntimeError, EOFError) as e:
            return str(e)

    def close(self) -> None:
        try:
            self.link.send({"op": "quit"})
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()  # our own child, by handle
            self.proc.wait()


def _rescue(snd: Sender, peer: Remote, exe: ExecutorProcess, answered: bool) -> None:
    """Unblock both processes after a failed run: force the child's doorbells and our done flags to 1 until
    our stream has drained and the child has answered its run, then zero them."""
    rescue = torch.cuda.Stream(device=snd.own.device)
    end = mark(snd.stream)
    deadline = time.monotonic() + 10
    while not (answered and end.query()):
        # Each fill lets a stuck side through one round of waits: refill often, a run has many steps.
        peer.flags.fill(rescue, 1)
        snd.own.flags.fill(rescue, 1)
        answered = answered or exe.poll(0.001) is not None
        if time.monotonic() > deadline:
            raise Stuck("sender and executor processes still blocked after their flags were forced to 1")
    peer.flags.fill(rescue, 0)
    snd.own.flags.fill(rescue, 0)
    rescue.synchronize()


def signalled(snd: Sender, peer: Remote, exe: ExecutorProcess, bs: int, mode: str, steps: int, warmup: int,
              repeats: int, seed: int) -> dict[str, Any]:
    """GPU-signalled steps across the two processes: a checked step, then timed runs (ms per step)."""
    graph = capture(snd.stream, lambda: snd.step(bs)) if mode == "graph" else None
    if graph is not None:
        exe.call("capture", bs=bs)

    def enqueue() -> None:
        if graph is not None:
            replay(graph, snd.stream)
        else:
            snd.step(bs)

    def run(n_warm: int, n_timed: int) -> float:
        exe.call("run", bs=bs, mode=mode, steps=n_warm + n_timed)  # answers once it is enqueueing
        error, e0, e1 = "", None, None
        try:
            for _ in range(n_warm):
                enqueue()
            e0 = mark(snd.stream)
            for _ in range(n_timed):
                enqueue()
            e1 = mark(snd.stream)
            if not wait_events([e1], exe.timeout):
                error = f"sender stream did not finish within {exe.timeout} s"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        reply = exe.poll(0.0 if error else exe.timeout)
        if error or not isinstance(reply, dict):
            _rescue(snd, peer, exe, answered=reply is not None)
            raise RuntimeError(error or f"executor process: {reply or 'no answer'}")
        assert e0 is not None and e1 is not None
        return e0.elapsed_time(e1) / n_timed

    snd.refresh(bs, seed)
    run(0, 1)
    ok = snd.check(bs) and snd.own.flags.read() == [0] * snd.geo.layers == peer.flags.read()
    times = [run(warmup, steps) for _ in range(repeats)]
    return {"ms_per_step": times, "check": ok}


def data_only(snd: Sender, exe: ExecutorProcess, bs: int, mode: str, steps: int, warmup: int,
              repeats: int) -> dict[str, Any]:
    """The same copies with no signalling: our pushes timed here, the child's compute + pushes there."""
    graph = capture(snd.stream, lambda: snd.data_only(bs)) if mode == "graph" else None
    mine = time_stream((lambda: replay(graph, snd.stream)) if graph is not None else (lambda: snd.data_only(bs)),
                       snd.stream, steps, warmup, repeats)
    theirs = exe.call("data", bs=bs, mode=mode, steps=steps, warmup=warmup, repeats=repeats)["ms"]
    return {"send_ms": mine, "exec_ms": theirs}


def cpu_driven(snd: Sender, exe: ExecutorProcess, bs: int, steps: int, warmup: int, repeats: int,
               seed: int) -> dict[str, Any]:
    """Per layer: push q|k|v and wait for it on the host, hand the layer to the child over the pipe, the
    child computes, pushes o, waits for it and hands back."""
    layers = snd.geo.layers

    def run(n: int) -> float:
        exe.call("cpu", bs=bs, steps=n)
        t0 = time.perf_counter()
        for _ in range(n):
            for layer in range(layers):
                snd.cpu_push(layer, bs)
                exe.link.send_token()
                exe.link.recv_token(exe.timeout)
        dt = time.perf_counter() - t0
        exe.link.recv(exe.timeout)
        return dt * 1e3 / n

    snd.refresh(bs, seed)
    run(1)
    ok = snd.check(bs)
    times = []
    for _ in range(repeats):
        run(warmup)
        times.append(run(steps))
    return {"ms_per_step": times, "check": ok}


# ---- child (executor) -------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # prints from here on go to stderr; the protocol owns out_fd
    link = Link(0, out_fd)
    geo = Geometry(layers=args.layers, max_bs=args.max_bs)
    torch.cuda.set_device(args.device)
    own = Buffers(geo, args.device, seed=2)
    link.send({"buffers": own.export()})
    msg = link.recv(args.timeout * 6)
    peer, maps = Remote.open(msg["buffers"], args.device, geo)
    exe = Executor(own, peer)
    link.send({"ok": True})
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    while True:
        try:
            msg = link.recv(3600)
        except (EOFError, TimeoutError):
            break
        op, bs = msg["op"], msg.get("bs", 0)
        try:
            if op == "quit":
                break
            if op == "capture":
                graphs = {"step": capture(exe.stream, lambda bs=bs: exe.step(bs))}
                link.send({"ok": True})
            elif op == "run":
                link.send({"started": True})
                for _ in range(msg["steps"]):
                    if msg["mode"] == "graph":
                        replay(graphs["step"], exe.stream)
                    else:
                        exe.step(bs)
                if not wait_events([mark(exe.stream)], args.timeout * 3):
                    raise TimeoutError("executor stream did not finish (a doorbell never rang)")
                link.send({"ok": True})
            elif op == "data":
                link.send({"ms": _time_data(exe, bs, msg)})
            elif op == "cpu":
                link.send({"started": True})
                for _ in range(msg["steps"]):
                    for layer in range(geo.layers):
                        link.recv_token(args.timeout)
                        exe.cpu_layer(layer, bs)
                        link.send_token()
                link.send({"ok": True})
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:
            link.send({"error": f"{op}: {type(e).__name__}: {e}"})
            if isinstance(e, TimeoutError | EOFError):
                break  # the stream may still be blocked: leave, the parent gives up on this process
    for m in maps:
        m.close()


def _time_data(exe: Executor, bs: int, msg: dict[str, Any]) -> list[float]:
    graph = capture(exe.stream, lambda: exe.data_only(bs)) if msg["mode"] == "graph" else None
    enqueue = (lambda: replay(graph, exe.stream)) if graph is not None else (lambda: exe.data_only(bs))
    return time_stream(enqueue, exe.stream, msg["steps"], msg["warmup"], msg["repeats"])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="executor child of bench/remote_attention.py (two processes)")
    p.add_argument("--child", action="store_true", required=True)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--max-bs", type=int, default=256)
    p.add_argument("--timeout", type=float, default=10.0)
    child(p.parse_args())
