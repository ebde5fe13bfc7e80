"""A worker's event loop: asyncio + uvloop over one ZeroMQ DEALER socket that *connects* to its router
(or offline Engine), so a worker can join from another process or host and leave without taking the
router down. Every scheduler call happens on the one forward thread, in order; prompts are tokenized
on two lanes before (short ones and long ones, so a multi-MB prompt delays neither the running
requests nor a short prompt behind it). Details: docs/architecture.md, "Worker".

    recv ─┬─ text/messages ──> tokenize lane (short | long) ──> grammar pool (constrained only) ─┐
          └─ input_ids, abort, flush, shutdown ──────────────────────────────────────────────────┴─> inbox
    inbox ─> forward thread: Worker.step

A constrained request takes the lanes even with input_ids (its grammar compiles on the grammar pool,
grammar/pool.py: several threads, small constraints never behind large ones, cache hits at once; the
compiled grammar goes with the request to the forward thread, which never compiles).
An exception out of `Worker.step` is fatal: every request gets an explicit error and the process
exits 1, for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import msgspec
import zmq
import zmq.asyncio

from sglang_ext.engine.model_runner import bind_device
from sglang_ext.grammar.backend import constraint_of
from sglang_ext.grammar.pool import GrammarBusy
from sglang_ext.messages import (
    AbortReq,
    DetokenizeReq,
    ErrorOut,
    FromWorker,
    GenerateReq,
    HelloReq,
    TokenizeReq,
    ToWorker,
    WorkerHello,
    decode_to_worker,
    encode,
)
from sglang_ext.sampling.params import InvalidRequest
from sglang_ext.server_args import ServerArgs
from sglang_ext.transport.link import local_address_toward
from sglang_ext.worker.disagg import CLOSE_GRACE_S
from sglang_ext.worker.tokenizer import StartupError
from sglang_ext.worker.worker import Worker

logger = logging.getLogger(__name__)
HEARTBEAT_S = 0.5
SHORT_PROMPT_CHARS: Final = 16384  # ~4K tokens, a few ms to tokenize: the short lane
EXIT_FATAL: Final = 1  # a runtime failure: restart me
EXIT_STARTUP: Final = 2  # a configuration error (bad model path, no tokenizer): restarting will not help


def forward_pool(device: str) -> ThreadPoolExecutor:
    """The one thread that runs the model. The current CUDA device is per thread: this one must be on
    the worker's GPU, or Triton kernels given tensors of cuda:1 launch on cuda:0 ("cannot be accessed
    from Triton")."""
    return ThreadPoolExecutor(1, thread_name_prefix="forward", initializer=bind_device, initargs=(device,))


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
        self.pool = forward_pool(worker.args.resolved_device)
        # One thread per lane: a lane tokenizes one prompt at a time, which also bounds the memory
        # that tokenizing takes to one long prompt's.
        self.short_lane = ThreadPoolExecutor(1, thread_name_prefix="tokenize-short")
        self.long_lane = ThreadPoolExecutor(1, thread_name_prefix="tokenize-long")
        self.tokenizing: dict[str, bool] = {}  # rid -> aborted meanwhile
        self.abort_notes: dict[str, str] = {}  # rid aborted while tokenizing -> its abort message
        self.tasks: set[asyncio.Task[None]] = set()
        self.parent_pid = os.getppid()
        # Executors this worker hosts are reached where the router reaches it.
        toward = local_address_toward(router_addr.split("://", 1)[-1].rpartition(":")[0])
        if worker.remote_control.host is not None:
            worker.remote_control.host.address = toward
        worker.disagg.address = toward  # prefill workers reach this one's KV pairs there too

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
            try:
                await self._route(msg)
            except Exception:  # one odd message must not stop the worker from receiving
                logger.exception("dropping a %s message (rid %r) that could not be routed", type(msg).__name__,
                                 getattr(msg, "rid", None))

    async def _route(self, msg: ToWorker) -> None:
        if isinstance(msg, GenerateReq) and msg.rid not in self.worker.received:
            self.worker.received[msg.rid] = time.monotonic()
        if isinstance(msg, HelloReq):  # answered here: it must not wait behind a forward
            await self.send([WorkerHello(info=self.worker.info())])
        elif isinstance(msg, AbortReq) and msg.rid in self.tokenizing:
            self.tokenizing[msg.rid] = True  # dropped when its tokenization ends, answered as aborted
            self.abort_notes[msg.rid] = msg.message
        elif isinstance(msg, TokenizeReq | DetokenizeReq) or (isinstance(msg, GenerateReq) and (
                msg.input_ids is None or constraint_of(msg.sampling_params) is not None)):
            await self._start_tokenizing(msg)
        else:
            self.inbox.append(msg)
            self.wake.set()

    async def _start_tokenizing(self, msg: GenerateReq | TokenizeReq | DetokenizeReq) -> None:
        if msg.rid in self.tokenizing:
            await self.send([ErrorOut(rid=msg.rid, message=f"duplicate request id {msg.rid!r}", status=400)])
            return
        self.tokenizing[msg.rid] = False
        chars = 0 if isinstance(msg, DetokenizeReq) else self.worker.prompt_chars(
            msg.text, msg.messages, msg.tools if isinstance(msg, GenerateReq) else None)
        lane = self.short_lane if chars <= SHORT_PROMPT_CHARS else self.long_lane
        task = asyncio.create_task(self._tokenize(msg, lane))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _tokenize(self, msg: GenerateReq | TokenizeReq | DetokenizeReq, lane: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        fn = (self.worker.prepare if isinstance(msg, GenerateReq) else self.worker.reply_tokenize
              if isinstance(msg, TokenizeReq) else self.worker.reply_detokenize)
        grammar = None
        try:
            result: ToWorker | FromWorker = await loop.run_in_executor(lane, fn, msg)  # type: ignore[arg-type]
            if isinstance(result, GenerateReq) and (pending := self.worker.submit_grammar(result)) is not None:
                grammar = await asyncio.wrap_future(pending)  # a cache hit is done already
        except InvalidRequest as e:
            result = ErrorOut(rid=msg.rid, message=str(e), status=400)
        except GrammarBusy as e:  # the compile pool is full: this request may be retried
            result = ErrorOut(rid=msg.rid, message=str(e), status=429)
        except Exception as e:  # a bug or a broken tokenizer, not the client's input: 500, logged
            logger.exception("tokenizing request %s failed", msg.rid)
            result = ErrorOut(rid=msg.rid, message=f"internal error while tokenizing: {type(e).__name__}: {e}",
                              status=500)
        aborted = self.tokenizing.pop(msg.rid, True)
        if aborted or not isinstance(result, GenerateReq):
            self.worker.received.pop(msg.rid, None)  # it never reaches the forward thread
        if aborted:
            # Aborted meanwhile: a generation ends as any aborted one does (an Engine waits for its
            # end). Or the worker is failing and has answered it already.
            note = self.abort_notes.pop(msg.rid, None)
            if note is not None and isinstance(msg, GenerateReq):
                await self.send([self.worker.aborted(msg.rid, note)])
            return
        if isinstance(result, GenerateReq):
            if grammar is not None:
                self.worker.compiled_grammars[result.rid] = grammar
            self.inbox.append(result)
            self.wake.set()
        else:
            await self.send([result])  # type: ignore[list-item]

    async def _heartbeat_loop(self) -> None:
        while True:
            await self.send([self.worker.load_report()])
            if os.getppid() != self.parent_pid and self.parent_pid != 1:
                logger.warning("parent process exited; worker %s stops", self.worker.worker_id)
                self.worker.stopped = True
                self.wake.set()
            await asyncio.sleep(HEARTBEAT_S)

    async def run(self) -> int:
        """Serve until shutdown (returns 0) or a fatal error (returns EXIT_FATAL)."""
        self.sock.connect(self.router_addr)
        loop = asyncio.get_running_loop()
        def notify() -> None:  # KV sent or landed
            loop.call_soon_threadsafe(self.wake.set)
        self.worker.disagg.notify = notify
        await self.send([WorkerHello(info=self.worker.info())])
        tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]
        code = 0
        try:
            while not self.worker.stopped:
                if not self.inbox and not self.worker.has_work():
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                inbox, self.inbox = self.inbox, []
                try:
                    out = await loop.run_in_executor(self.pool, self.worker.step, inbox)
                except Exception as e:
                    code = EXIT_FATAL
                    await self._fail_everything(e, inbox)
                    break
                await self.send(out)
        finally:
            # Pair threads that end after the loop has closed must not wake it (call_soon_threadsafe
            # would raise in them).
            self.worker.disagg.notify = lambda: None
            for t in tasks:
                t.cancel()
            self.pool.shutdown(wait=False)
            for lane in (self.short_lane, self.long_lane):
                lane.shutdown(wait=False, cancel_futures=True)
            if self.worker.grammars is not None:
                self.worker.grammars.pool.close()
            self.sock.close()
            self.ctx.term()
        return code

    async def _fail_everything(self, e: Exception, inbox: list[ToWorker]) -> None:
        """After a fatal error (a CUDA fault leaves the device unusable; a bug, the scheduler's state
        untrusted), every request this worker holds fails explicitly instead of hanging."""
        logger.exception("fatal error in worker %s; failing all its requests and exiting", self.worker.worker_id)
        message = (f"worker {self.worker.worker_id} failed ({type(e).__name__}: {e}); "
                   "it exits and is restarted by its launcher")
        pending = {m.rid for m in [*inbox, *self.inbox, *self.worker.weights.held]
                   if isinstance(m, GenerateReq | TokenizeReq | DetokenizeReq)}
        pending |= {rid for rid, aborted in self.tokenizing.items() if not aborted}
        pending |= {m.rid for m in self.worker.weights.pending}  # reloads waiting for the drain
        self.tokenizing = {rid: True for rid in self.tokenizing}  # their tokenization ends unanswered
        self.abort_notes.clear()
        await self.send(self.worker.fatal_errors(message, pending))
        self.sock.setsockopt(zmq.LINGER, 2000)  # deliver those errors before the socket closes


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
    try:
        worker = Worker(args, worker_id)
    except StartupError as e:  # a configuration problem: one clear line, no traceback
        logger.error("cannot start: %s", e)
        sys.exit(EXIT_STARTUP)
    code = asyncio.run(WorkerServer(worker, router_addr).run())
    finish(worker, code)


def finish(worker: Worker, code: int) -> None:
    """After serving: close the worker's pairs, then return (a normal exit, with interpreter teardown)
    or, when that teardown could hang or abort, exit at once with `code`."""
    # After a fatal error the process exits at once anyway: no grace for goodbyes.
    pairs_ended = worker.disagg.close(grace_s=0.0 if code else CLOSE_GRACE_S)
    busy = worker.remote_control.close(worker.scheduler)
    if code or busy or not pairs_ended:
        # Skip interpreter teardown: after a device fault, joining threads or freeing CUDA memory
        # can hang, and the process must go so that its supervisor can restart it. Executor threads
        # still waiting on their senders, and KV pair threads on their peers, cannot be interrupted
        # either (their sockets close with us); left running into the teardown they would abort it
        # (WorkerDisagg.close says why).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
