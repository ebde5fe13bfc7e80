"""A worker's event loop: asyncio + uvloop over one ZeroMQ DEALER socket.

The loop sleeps until a message arrives or work is pending; each forward runs in one helper
thread (so heartbeats and new requests are taken while the model computes) and every scheduler
call happens on that thread, in order. The worker *connects* to its router (or offline Engine),
so it can join from another process or host and leave without taking the router down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq
import zmq.asyncio

from sglang_ext.messages import FromWorker, HelloReq, ToWorker, WorkerHello, decode_to_worker, encode
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.worker import Worker

logger = logging.getLogger(__name__)
HEARTBEAT_S = 0.5


class WorkerServer:
    def __init__(self, worker: Worker, router_addr: str) -> None:
        self.worker = worker
        self.router_addr = router_addr
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker.worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.inbox: list[ToWorker] = []
        self.wake = asyncio.Event()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="forward")
        self.parent_pid = os.getppid()

    async def send(self, msgs: list[FromWorker]) -> None:
        for m in msgs:
            await self.sock.send(encode(m))

    async def _recv_loop(self) -> None:
        while True:
            buf = await self.sock.recv()
            try:
                msg = decode_to_worker(buf)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # Strict decoding: a malformed control message is dropped and logged, never guessed.
                logger.warning("dropping malformed control message: %s", e)
                continue
            if isinstance(msg, HelloReq):  # answered here: it must not wait behind a forward
                await self.send([WorkerHello(info=self.worker.info())])
                continue
            self.inbox.append(msg)
            self.wake.set()

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.send([self.worker.load_report()])
            if os.getppid() != self.parent_pid and self.parent_pid != 1:
                logger.warning("parent process exited; worker %s stops", self.worker.worker_id)
                self.worker.stopped = True
                self.wake.set()
            await asyncio.sleep(HEARTBEAT_S)

    async def run(self) -> None:
        self.sock.connect(self.router_addr)
        await self.send([WorkerHello(info=self.worker.info())])
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]
        loop = asyncio.get_running_loop()
        try:
            while not self.worker.stopped:
                if not self.inbox and not self.worker.has_work():
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                inbox, self.inbox = self.inbox, []
                out = await loop.run_in_executor(self.pool, self.worker.step, inbox)
                await self.send(out)
        finally:
            for t in tasks:
                t.cancel()
            self.pool.shutdown(wait=False)
            self.sock.close(0)
            self.ctx.term()


def run_worker_encoded(args_json: bytes, router_addr: str, worker_id: str) -> None:
    """Spawn target: arguments cross the process boundary as JSON, not pickle."""
    run_worker(msgspec.json.decode(args_json, type=ServerArgs), router_addr, worker_id)


def run_worker(args: ServerArgs, router_addr: str, worker_id: str) -> None:
    """Process entry point (also used by `python -m sglang_ext.launch worker`)."""
    logging.basicConfig(level=args.log_level.upper(), format=f"[{worker_id}] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    worker = Worker(args, worker_id)
    asyncio.run(WorkerServer(worker, router_addr).run())
