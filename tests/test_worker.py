"""A worker's server loop in this process (a real ZeroMQ socket, the embedded default model): prompts
are tokenized off the forward thread, oversized prompts are refused before tokenizing, aborts reach
requests still being tokenized, and a fatal error fails every request and ends the loop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from sglang_ext.entry import engine as engine_mod
from sglang_ext.entry.engine import Engine, WorkerDied
from sglang_ext.messages import (
    AbortReq,
    BatchOut,
    ErrorOut,
    GenerateReq,
    LoadReport,
    ReplyOut,
    ShutdownReq,
    TokenizeReq,
    WorkerHello,
    decode_from_worker,
    encode,
)
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.server import EXIT_FATAL, SHORT_PROMPT_CHARS, WorkerServer
from sglang_ext.worker.worker import FATAL_STATUS, Worker

CORPUS = (Path(__file__).resolve().parents[1] / "sglang_ext/models/default_corpus.txt").read_text()
# A long context so that a multi-MB prompt is within the character limit and really gets tokenized
# (~1-2 s on one core) before the scheduler rejects it by length.
LONG_CTX = 200_000
BIG_CHARS = 2_000_000


def _args(**kw: Any) -> ServerArgs:
    return ServerArgs(device="cpu", dtype="float32", page_size=4, max_total_tokens=8192, **kw)


def _sp(n: int = 4) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _big_text(chars: int) -> str:
    return (CORPUS * (chars // len(CORPUS) + 1))[:chars]


class InProcessWorker:
    """A WorkerServer on its own thread and event loop; the test holds the ROUTER end."""

    def __init__(self, worker: Worker, tmp: Path) -> None:
        self.worker = worker
        addr = f"ipc://{tmp}/worker.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.code: int | None = None
        self.thread = threading.Thread(target=self._main, args=(addr,), daemon=True)
        self.thread.start()
        while not isinstance(self.recv(5.0), WorkerHello):
            pass

    def _main(self, addr: str) -> None:
        async def go() -> int:
            return await WorkerServer(self.worker, addr).run()

        self.code = asyncio.run(go())

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send_multipart([self.worker.worker_id.encode(), encode(msg)])

    def recv(self, timeout: float) -> Any:
        """The next message other than a heartbeat; None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000)) == 0:
                return None
            msg = decode_from_worker(self.sock.recv_multipart()[1])
            if not isinstance(msg, LoadReport):
                return msg
        return None

    def until_done(self, rids: set[str], timeout: float = 120.0) -> list[tuple[str, Any]]:
        """(rid, final message) in the order requests ended: a finished TokenOut, an error or a reply."""
        ended: list[tuple[str, Any]] = []
        deadline = time.monotonic() + timeout
        while {r for r, _ in ended} != rids:
            assert time.monotonic() < deadline, f"timed out; ended so far: {ended}"
            msg = self.recv(1.0)
            if isinstance(msg, BatchOut):
                ended += [(o.rid, o) for o in msg.outs if o.finished]
            elif isinstance(msg, ErrorOut | ReplyOut):
                ended.append((msg.rid, msg))
        return ended

    def stop(self) -> None:
        if self.thread.is_alive():
            self.send(ShutdownReq())
            self.thread.join(30)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessWorker]:
    w = InProcessWorker(Worker(_args(context_length=LONG_CTX)), tmp_path_factory.mktemp("served"))
    yield w
    w.stop()
    assert w.code == 0


def test_big_prompt_does_not_hold_up_a_small_one(served: InProcessWorker) -> None:
    """Tokenizing a multi-MB prompt (within the limit) takes seconds; a short request sent after it
    must not wait for that (it used to: prompts were tokenized in order on the forward thread)."""
    served.send(GenerateReq(rid="big", text=_big_text(BIG_CHARS), sampling_params=_sp()))
    served.send(GenerateReq(rid="small", text="Once upon a time,", sampling_params=_sp()))
    ended = served.until_done({"big", "small"})
    assert [r for r, _ in ended] == ["small", "big"]
    small, big = ended[0][1], ended[1][1]
    assert small.meta_info["completion_tokens"] == 4
    # It was tokenized (within the character limit) and then refused by length.
    assert isinstance(big, ErrorOut) and big.status == 400 and "context length" in big.message


def test_oversized_prompt_is_refused_before_tokenizing(served: InProcessWorker) -> None:
    limit = LONG_CTX * served.worker.max_token_chars
    assert served.worker.info().max_token_chars == served.worker.max_token_chars > 1
    t0 = time.monotonic()
    served.send(GenerateReq(rid="huge", text="x" * (limit + 1), sampling_params=_sp()))
    [(_, err)] = served.until_done({"huge"})
    assert isinstance(err, ErrorOut) and err.status == 400
    assert f"the limit is {limit}" in err.message and "characters" in err.message
    # Chat messages count every string in them, summed over the messages.
    half = "y" * (limit // 2 + 1)
    msgs = [{"role": "user", "content": half}, {"role": "assistant", "content": [{"type": "text", "text": half}]}]
    served.send(GenerateReq(rid="chat", messages=msgs, sampling_params=_sp()))
    served.send(TokenizeReq(rid="tok", messages=msgs))
    ended = dict(served.until_done({"chat", "tok"}))
    for rid in ("chat", "tok"):
        assert isinstance(ended[rid], ErrorOut) and "messages' text" in ended[rid].message
    assert time.monotonic() - t0 < 30  # refused, not tokenized (tokenizing 3 x ~3 MB takes far longer)


def test_abort_reaches_a_request_still_being_tokenized(served: InProcessWorker) -> None:
    served.send(GenerateReq(rid="doomed", text=_big_text(BIG_CHARS), sampling_params=_sp()))
    served.send(AbortReq(rid="doomed"))
    # The long lane is first in, first out: this reply comes after "doomed" was tokenized.
    served.send(TokenizeReq(rid="probe", text=_big_text(SHORT_PROMPT_CHARS + 1)))
    served.send(GenerateReq(rid="after", text="Hello", sampling_params=_sp(2)))
    seen: list[str] = []
    ends: dict[str, Any] = {}
    deadline = time.monotonic() + 120
    while not {"probe", "after"} <= set(seen):
        assert time.monotonic() < deadline
        msg = served.recv(1.0)
        if isinstance(msg, BatchOut):
            seen += [o.rid for o in msg.outs if o.finished]
            ends.update({o.rid: o for o in msg.outs if o.finished})
        elif isinstance(msg, ErrorOut | ReplyOut):
            seen.append(msg.rid)
    # Cancelled: never scheduled, and answered as an aborted request (an offline Engine waits for its end).
    assert seen.count("doomed") == 1 and seen.index("doomed") < seen.index("probe")
    assert ends["doomed"].meta_info["finish_reason"]["type"] == "abort" and not ends["doomed"].token_ids
    assert not served.worker.live and "doomed" not in {r.rid for r in served.worker.scheduler.waiting}
    assert not served.worker.received  # an aborted or refused request leaves no receipt time behind


def test_ttft_counts_from_the_workers_receipt(served: InProcessWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    """meta_info's ttft and e2e_latency start when the worker's event loop received the request, so its
    tokenizing (and its wait for the forward thread) is in them: a prompt whose tokenizing takes 0.5 s
    reports a TTFT of at least that."""
    real = served.worker.prepare

    def slow(m: GenerateReq) -> GenerateReq:
        time.sleep(0.5)
        return real(m)

    monkeypatch.setattr(served.worker, "prepare", slow)
    served.send(GenerateReq(rid="slow-tok", text="Hello there", sampling_params=_sp(2)))
    [(_, out)] = served.until_done({"slow-tok"})
    assert out.meta_info["ttft"] >= 0.5 and out.meta_info["e2e_latency"] >= out.meta_info["ttft"]
    assert "slow-tok" not in served.worker.received


def test_chat_template_errors_are_400_and_server_bugs_500(served: InProcessWorker,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tok = served.worker.tokenizer
    assert tok is not None
    served.send(GenerateReq(rid="no-content", messages=[{"role": "user"}], sampling_params=_sp()))
    [(_, err)] = served.until_done({"no-content"})
    assert isinstance(err, ErrorOut) and err.status == 400 and "chat template" in err.message

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("tokenizer backend crashed")

    monkeypatch.setattr(tok.hf, "apply_chat_template", broken)
    served.send(GenerateReq(rid="bug", messages=[{"role": "user", "content": "hi"}], sampling_params=_sp()))
    [(_, err)] = served.until_done({"bug"})
    assert isinstance(err, ErrorOut) and err.status == 500 and "tokenizer backend crashed" in err.message
    monkeypatch.undo()
    served.send(GenerateReq(rid="ok", messages=[{"role": "user", "content": "hi"}], sampling_params=_sp(2)))
    [(_, out)] = served.until_done({"ok"})
    assert out.meta_info["completion_tokens"] == 2


def test_bad_input_fails_only_its_request_and_a_fatal_error_fails_all(tmp_path: Path) -> None:
    w = Worker(_args())
    srv = InProcessWorker(w, tmp_path)
    try:
        srv.send(GenerateReq(rid="bad", input_ids=[10**7], sampling_params=_sp()))
        srv.send(GenerateReq(rid="good", input_ids=[1, 40, 50], sampling_params=_sp()))
        ended = dict(srv.until_done({"bad", "good"}))
        assert isinstance(ended["bad"], ErrorOut) and ended["bad"].status == 400
        assert ended["good"].meta_info["completion_tokens"] == 4

        real = w.runner.forward

        def boom(batch: object) -> object:
            # Fail only once the worker holds both requests. A request that has not reached the worker
            # when it dies is failed by the router (the process is gone), not by the worker: under load,
            # "b" (tokenized first) could otherwise still be unread when "a"'s step raises.
            sched = w.scheduler
            held = {r.rid for q in (sched.waiting, sched.running) for r in q}
            if not {"a", "b"} <= held:
                return real(batch)  # type: ignore[arg-type]
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        w.runner.forward = boom  # type: ignore[method-assign]
        srv.send(GenerateReq(rid="a", input_ids=[1, 40, 50], sampling_params=_sp(50)))
        srv.send(GenerateReq(rid="b", text="Hello", sampling_params=_sp(50)))
        ended = dict(srv.until_done({"a", "b"}))
        for rid in ("a", "b"):
            err = ended[rid]
            assert isinstance(err, ErrorOut) and err.status == FATAL_STATUS
            assert "illegal memory access" in err.message and "restarted" in err.message
        srv.thread.join(30)
        assert srv.code == EXIT_FATAL  # the loop ended: no heartbeats from a broken worker
    finally:
        srv.stop()


def test_engine_raises_worker_died_and_the_process_exits_nonzero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker process itself: a forward that raises makes it fail the request and exit 1."""
    code = (
        "import sys\n"
        "from sglang_ext.engine.model_runner import ModelRunner\n"
        "def boom(self, batch):\n"
        "    raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
        "ModelRunner.forward = boom\n"
        "from sglang_ext.worker.server import run_worker_encoded\n"
        "run_worker_encoded(sys.argv[3].encode(), sys.argv[1], sys.argv[2])\n"
    )

    def spawn(args: ServerArgs, addr: str, wid: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", code, addr, wid, msgspec.json.encode(args).decode()]
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    monkeypatch.setattr(engine_mod, "spawn_worker", spawn)
    with Engine(device="cpu", dtype="float32", max_total_tokens=4096) as eng:
        with pytest.raises(WorkerDied, match="illegal memory access"):
            eng.generate(prompt=["Hello", "Hi"], sampling_params={"max_new_tokens": 4})
        assert eng._proc is not None and eng._proc.wait(30) == EXIT_FATAL
        with pytest.raises(WorkerDied, match="exited with code 1"):
            eng.generate(prompt="again", sampling_params={"max_new_tokens": 4})


def test_startup_logs_each_stage_with_its_time(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="sglang_ext.startup"):
        w = Worker(_args())
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_ext.startup"]
    for stage in ("config", "tokenizer", "weights", "kv pool", "attention backend", "cuda graphs", "scheduler"):
        assert any(ln.startswith(f"{stage} ") and " s" in ln for ln in lines), (stage, lines)
    assert any("zero-filled" in ln for ln in lines)  # the torch backend reads whole pages: zeros
    assert lines[-1].startswith(f"worker {w.worker_id} ready in ")


@pytest.mark.parametrize(("model_path", "extra", "needle"), [
    ("/nonexistent/model", {}, "is not a local directory"),
    ("preset:gpt-5", {"load_format": "dummy"}, "unknown preset"),
    ("preset:llama-3-8b", {}, "add --load-format dummy"),
    ("NO_WEIGHTS", {"skip_tokenizer_init": True}, "no *.safetensors"),
])
def test_configuration_errors_are_one_line_startup_errors(tmp_path: Path, model_path: str, extra: dict[str, Any],
                                                          needle: str) -> None:
    from sglang_ext.models.default_model import ensure_default_model
    from sglang_ext.worker.tokenizer import StartupError

    if model_path == "NO_WEIGHTS":
        (tmp_path / "config.json").write_bytes((ensure_default_model() / "config.json").read_bytes())
        model_path = str(tmp_path)
    with pytest.raises(StartupError) as e:
        Worker(_args(model_path=model_path, **extra))
    assert needle in str(e.value) and "\n" not in str(e.value)
