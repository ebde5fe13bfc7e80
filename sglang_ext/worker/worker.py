"""A worker's logic without sockets: messages in, messages out, one forward per `step`.

`prepare` (tokenizing) is separate from `step` so the server can run it on another thread; `step`
takes requests with input_ids. An exception out of `step` is fatal (the device or the scheduler's
state can no longer be trusted): the server fails every request and exits. A bad request only
fails itself (`InvalidRequest` -> a 400 for its rid).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sglang_ext.disagg.transfer import KVArrival
from sglang_ext.engine.model_runner import ModelRunner, StartupTimer
from sglang_ext.grammar.backend import GrammarBackend, GrammarState, constraint_of
from sglang_ext.grammar.pool import GrammarBusy
from sglang_ext.messages import (
    AbortReq,
    BatchOut,
    DetokenizeReq,
    ErrorOut,
    ExecutorOpen,
    ExpertDistributionReq,
    FlushCacheReq,
    FromWorker,
    GenerateReq,
    KVPairClose,
    KVPairConnect,
    KVPairOpen,
    LoadReport,
    OffloadDirective,
    OffloadRatio,
    ProfileReq,
    ReplyOut,
    ShutdownReq,
    TokenizeReq,
    TokenOut,
    ToWorker,
    UpdateWeightsReq,
    WorkerInfo,
)
from sglang_ext.messages.io import RotationStats
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.resolve import PRESET_PREFIX, resolve_model_path
from sglang_ext.offload.setup import local_sender
from sglang_ext.sampling.params import InvalidRequest
from sglang_ext.scheduler.output import StepOutput
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler, default_overlap
from sglang_ext.server_args import ServerArgs
from sglang_ext.transport.choice import cuda_ipc_problem
from sglang_ext.worker.disagg import PairGone, WorkerDisagg
from sglang_ext.worker.expert_distribution import make_recorder
from sglang_ext.worker.local_planning import LocalPlanning
from sglang_ext.worker.profile import make_profiler, on_demand
from sglang_ext.worker.remote_control import RemoteAttentionControl
from sglang_ext.worker.stats import DECODE_STEP_WINDOW_S, LatencyWindow, latency, present
from sglang_ext.worker.step_log import make_step_log
from sglang_ext.worker.tokenizer import IncrementalDetokenizer, StartupError, Tokenizer, load_tokenizer
from sglang_ext.worker.weights import WeightUpdates, reload

logger = logging.getLogger(__name__)
# A request failed because its worker died: the same status the router gives when a worker vanishes.
FATAL_STATUS = 503
FLUSH_SETTLE_S = 5.0  # a cache flush waits this long at most for KV sends in flight (disaggregation)


@dataclass
class _Live:
    req: GenerateReq
    start: float
    detok: IncrementalDetokenizer | None
    meta: dict[str, Any] = field(default_factory=dict)
    first_token_time: float | None = None


class Worker:
    def __init__(self, args: ServerArgs, worker_id: str = "worker-0") -> None:
        self.args = args
        self.worker_id = worker_id
        timer = StartupTimer()
        with timer.stage("config") as notes:
            try:
                self.model_dir = resolve_model_path(args.model_path)
                self.cfg = ModelConfig.from_path(self.model_dir)
            except (FileNotFoundError, ValueError) as e:  # a wrong --model-path: say so in one line
                raise StartupError(str(e)) from None
            except KeyError as e:
                raise StartupError(f"the config.json of {args.model_path!r} has no {e} field") from None
            if (args.model_path or "").startswith(PRESET_PREFIX) and args.load_format != "dummy":
                raise StartupError(f"{args.model_path} is a geometry without weights: add --load-format dummy")
            notes += [self.cfg.architecture, str(self.model_dir)]
        if args.offload_transport == "cuda_ipc" and (problem := cuda_ipc_problem(args.resolved_device)):
            raise StartupError(problem)
        # Before the weights: a missing tokenizer is reported in seconds, not after loading 16 GB.
        with timer.stage("tokenizer") as notes:
            self.tokenizer: Tokenizer | None = load_tokenizer(args, self.model_dir, self.cfg)
            self.max_token_chars = self.tokenizer.max_token_chars if self.tokenizer else 0
            notes.append(f"{len(self.tokenizer.hf)} tokens, longest {self.max_token_chars} chars"
                         if self.tokenizer else "skipped")
        if args.moe_routing_simulation != "off" and self.cfg.moe is None:
            raise StartupError(f"--moe-routing-simulation {args.moe_routing_simulation}: {self.cfg.architecture} "
                               "has no MoE layers")
        if args.expert_distribution_recorder_mode is not None and self.cfg.moe is None:
            raise StartupError(f"--expert-distribution-recorder-mode {args.expert_distribution_recorder_mode}: "
                               f"{self.cfg.architecture} has no MoE layers, so no expert distribution to record")
        try:
            self.runner = ModelRunner(args, self.model_dir, self.cfg, timer=timer)
        except FileNotFoundError as e:  # no weight files: a configuration problem, one line
            raise StartupError(str(e)) from None
        self.model_name = args.served_model_name or (
            "default" if args.model_path is None else str(args.model_path).rstrip("/").split("/")[-1])
        self.expert_record = make_recorder(self.runner.expert_counts, self.cfg.moe is not None, worker_id,
                                           self.model_name)
        self.remote_control = RemoteAttentionControl(args, self.runner, worker_id, self.model_name)
        self.disagg = WorkerDisagg(args.disaggregation_mode or "", self.runner, worker_id)
        self.disagg.placer.host = self.remote_control.host  # Adrenaline placement: prefill KV kept in its executor
        eos = set(self.cfg.eos_token_ids) | set(self.tokenizer.eos_ids if self.tokenizer else ())
        with timer.stage("scheduler"):
            # A prefill worker hands each request off right after its first token: nothing to overlap,
            # and a hand-off must not meet a step in flight.
            overlap = default_overlap(self.runner.device,
                                      args.disable_overlap_schedule or args.disaggregation_mode == "prefill")
            tok = self.tokenizer
            self.scheduler = Scheduler(
                args, self.runner, args.resolved_page_size, frozenset(eos),
                decode_fn=functools.partial(tok.decode, skip_special_tokens=False) if tok else None,
                vocab_size=self.cfg.vocab_size, remote_sender=local_sender(args, self.runner, worker_id),
                overlap=overlap,
            )
        # Nothing of xgrammar is loaded until a constrained request comes (grammar/backend.py).
        self.grammars = None
        if self.tokenizer is not None and args.grammar_backend != "none":
            self.grammars = GrammarBackend(
                self.tokenizer.hf, self.cfg.vocab_size, eos,
                any_whitespace=not args.constrained_json_disable_any_whitespace,
                workers=args.grammar_compile_workers, max_bytes=args.grammar_max_bytes,
                timeout_s=args.grammar_compile_timeout_s, cache_size=args.grammar_cache_size,
                queue_size=args.grammar_compile_queue_size)
        # rid -> its compiled grammar, put there by the server (compiled on the grammar pool) right
        # before the request enters the inbox, taken by _add on the forward thread: the forward thread
        # never compiles for a request that came through the server, even if the cache dropped it.
        self.compiled_grammars: dict[str, Any] = {}
        self.live: dict[str, _Live] = {}
        # rid -> when the worker's event loop received the request (time.monotonic), set by worker/server.py:
        # a request's TTFT and e2e latency count from there, so they include its tokenizing and its wait for
        # the forward thread's next step (which can be a whole prefill forward), not only what follows
        self.received: dict[str, float] = {}
        self.last_step_ms = 0.0
        self.step_log = make_step_log(args, worker_id)
        self.profiler = make_profiler(args, worker_id, cuda=self.runner.device.type == "cuda")
        self.weights = WeightUpdates()
        self.weights_path = str(args.model_path or "default")  # what /update_weights_from_disk loaded last
        self.tpot = LatencyWindow()
        self.ttft = LatencyWindow()  # first tokens computed here (a decode worker's come from prefill)
        # steps that decoded a running request: a short window, the planner looks every few seconds
        self.decode_steps = LatencyWindow(window_s=DECODE_STEP_WINDOW_S, max_samples=4096)
        # --offload-policy adaptive: this worker moves its in-process executor's share (worker/local_planning.py)
        self.local_planning = (LocalPlanning(args, self.scheduler, self.tpot, self.decode_steps)
                               if args.offload_executor is not None and args.offload_policy != "fixed" else None)
        self.stopped = False
        logging.getLogger("sglang_ext.startup").info("worker %s ready in %s", worker_id, timer.summary())

    # ---- identity -----------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        return self.remote_control.info(WorkerInfo(
            worker_id=self.worker_id, model_name=self.model_name, model_path=self.weights_path,
            architecture=self.cfg.architecture, context_length=self.runner.context_len,
            vocab_size=self.cfg.vocab_size, max_total_tokens=self.scheduler.max_total_tokens,
            page_size=self.args.resolved_page_size, device=str(self.runner.device),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            attention_backend=self.args.resolved_attention_backend,
            has_tokenizer=self.tokenizer is not None,
            chat_template=bool(self.tokenizer and self.tokenizer.has_chat_template), pid=os.getpid(),
            max_token_chars=self.max_token_chars, disaggregation_mode=self.args.disaggregation_mode or "",
            tool_call_parser=self.args.resolved_tool_call_parser, reasoning_parser=self.args.reasoning_parser or "",
            grammar_backend=self.args.grammar_backend,
        ))

    def load_report(self) -> LoadReport:
        s = self.scheduler.stats()
        ps = self.args.resolved_page_size
        offload, executor = self.remote_control.report(self.scheduler)
        return LoadReport(
            worker_id=self.worker_id, num_running=s.num_running, num_waiting=s.num_waiting,
            kv_used_tokens=s.kv_used_pages * ps, kv_total_tokens=s.kv_total_pages * ps,
            kv_cached_tokens=s.cached_pages * ps, num_preemptions=s.num_preemptions,
            step_time_ms=self.last_step_ms, timestamp=time.time(), decode_context_tokens=s.decode_context_tokens,
            latency=latency(self.tpot, self.ttft, self.decode_steps), offload=offload, executor=executor,
            rotation=present(RotationStats(
                rotary_reqs=s.num_rotary, host_used_bytes=s.host_used_bytes, host_total_bytes=s.host_total_bytes,
                rotations_out=s.rotations_out, rotations_in=s.rotations_in, bytes_out=s.rotation_bytes_out,
                bytes_in=s.rotation_bytes_in, unhidden_iterations=s.unhidden_iterations)),
            disagg=present(msgspec.structs.replace(self.disagg.counts)),  # a copy: the counts go on
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self.disagg.events.empty() or self.weights.draining

    # ---- tokenizing (any thread: touches only the tokenizer) ------------------------------------
    def prompt_chars(self, text: str | None, messages: list[dict[str, Any]] | None,
                     tools: list[dict[str, Any]] | None = None) -> int:
        if messages is not None:
            return _chars(messages) + (_chars(tools) if tools else 0)
        return len(text) if text is not None else 0

    def tokenize(self, text: str | None, messages: list[dict[str, Any]] | None, gen_prompt: bool = True,
                 add_special_tokens: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this server was started with skip_tokenizer_init: send input_ids, not text")
        # Refuse what cannot fit before tokenizing it: a 100 MB prompt would take minutes and tens of
        # GB to tokenize only to be rejected by length. Tokens >= characters / longest token.
        chars, ctx = self.prompt_chars(text, messages, tools), self.runner.context_len
        limit = ctx * self.max_token_chars
        if chars > limit:
            what = "the messages' text is" if messages is not None else "the prompt is"
            raise InvalidRequest(
                f"{what} {chars} characters; the limit is {limit} (context length {ctx} tokens x at most "
                f"{self.max_token_chars} characters per token), so it cannot fit"
            )
        if messages is not None:
            return self.tokenizer.apply_chat_template(messages, gen_prompt, tools)
        if text is None:
            raise InvalidRequest("give text or messages")
        return self.tokenizer.encode(text, add_special_tokens)

    def prepare(self, m: GenerateReq) -> GenerateReq:
        """The request with input_ids in place of text or messages (the prompt text is dropped)."""
        given = sum(x is not None for x in (m.input_ids, m.text, m.messages))
        if given != 1:
            raise InvalidRequest("give exactly one of text, input_ids or messages")
        if m.input_ids is not None:
            return m
        return msgspec.structs.replace(m, input_ids=self.tokenize(m.text, m.messages, tools=m.tools),
                                       text=None, messages=None, tools=None)

    def submit_grammar(self, m: GenerateReq) -> Future[Any] | None:
        """The request's constraint submitted to the compile pool (None without one): a future of its
        compiled grammar, already done when cached. InvalidRequest (400) or GrammarBusy (429) at once
        when it cannot be compiled here; the future may fail with either too (grammar/pool.py)."""
        c = constraint_of(m.sampling_params)
        if c is None:
            return None
        if self.grammars is None:
            why = ("this server was started with --grammar-backend none" if self.tokenizer is not None
                   else "it needs a tokenizer and this server was started with --skip-tokenizer-init")
            raise InvalidRequest(f"sampling_params.{c.kind}: structured output is not available: {why}")
        return self.grammars.submit(c)

    def compile_grammar(self, m: GenerateReq, compiled: Any = None) -> GrammarState | None:
        """A fresh matcher for the request's constraint (None without one), of `compiled` when the
        server compiled it already, else compiled here and waited for (callers without a server)."""
        if compiled is None:
            pending = self.submit_grammar(m)
            if pending is None:
                return None
            compiled = pending.result()
        return GrammarBackend.state(compiled)

    def reply_tokenize(self, m: TokenizeReq) -> ReplyOut:
        ids = self.tokenize(m.text, m.messages, m.add_generation_prompt, m.add_special_tokens)
        return ReplyOut(rid=m.rid, ok=True, data={"input_ids": ids})

    def reply_detokenize(self, m: DetokenizeReq) -> ReplyOut:
        if self.tokenizer is None:
            raise InvalidRequest("this server was started with skip_tokenizer_init: it has no tokenizer")
        n = len(self.tokenizer.hf)
        bad = next((t for t in m.tokens if not 0 <= t < n), None)
        if bad is not None:
            raise InvalidRequest(f"tokens: {bad} is not a token id of this model's tokenizer (ids are 0 .. {n - 1})")
        return ReplyOut(rid=m.rid, ok=True, data={"text": self.tokenizer.decode(m.tokens, m.skip_special_tokens)})

    # ---- messages in (the forward thread) -----------------------------------------------------------
    def handle(self, msg: ToWorker) -> list[FromWorker]:
        try:
            if isinstance(msg, GenerateReq):
                if self.weights.draining:
                    self.weights.held.append(msg)  # it runs on the new weights (weights.py)
                else:
                    self._add(msg)
            elif isinstance(msg, AbortReq):
                if self.weights.drop(msg.rid):
                    return [self.aborted(msg.rid, msg.message)]
                self.scheduler.abort(msg.rid, msg.message)
                if self.disagg.abort(msg.rid):
                    self.live.pop(msg.rid, None)  # the router closed it; nothing more is reported
            elif isinstance(msg, FlushCacheReq):
                # KV sends in flight still hold their requests' pages: let them complete first.
                out = self._disagg_events(settle_s=FLUSH_SETTLE_S)
                return [*out, ReplyOut(rid=msg.rid, ok=self.scheduler.flush_cache())]
            elif isinstance(msg, TokenizeReq):
                return [self.reply_tokenize(msg)]
            elif isinstance(msg, DetokenizeReq):
                return [self.reply_detokenize(msg)]
            elif isinstance(msg, ProfileReq):
                self.profiler, reply = on_demand(msg, self.profiler, self.worker_id, self.runner.device.type == "cuda")
                return [reply]
            elif isinstance(msg, ExpertDistributionReq):
                return [self.expert_record.handle(msg)]
            elif isinstance(msg, UpdateWeightsReq):
                self.weights.pending.append(msg)  # applied once the scheduler has drained (step)
            elif isinstance(msg, ExecutorOpen):
                return [self.remote_control.open_executor(msg)]
            elif isinstance(msg, KVPairOpen):
                return [self.disagg.open_pair(msg)]
            elif isinstance(msg, KVPairConnect):
                self.disagg.connect(msg)
            elif isinstance(msg, KVPairClose):
                self.disagg.close_pair(msg.pairing)
            elif isinstance(msg, OffloadDirective):
                self.remote_control.apply(msg, self.scheduler)
            elif isinstance(msg, OffloadRatio):
                self.remote_control.set_ratio(msg, self.scheduler)
            elif isinstance(msg, ShutdownReq):
                self.stopped = True
        except (InvalidRequest, PairGone, GrammarBusy) as e:
            rid = getattr(msg, "rid", "")
            self.live.pop(rid, None)
            if isinstance(msg, GenerateReq) and msg.disagg is not None and msg.disagg.role == "decode":
                self.disagg.refused(msg.disagg)
            status = 400 if isinstance(e, InvalidRequest) else 429 if isinstance(e, GrammarBusy) else 503
            return [ErrorOut(rid=rid, message=str(e), status=status)]
        return []

    def _add(self, m: GenerateReq) -> None:
        compiled = self.compiled_grammars.pop(m.rid, None)  # first: taken whatever happens below
        received = self.received.pop(m.rid, 0.0) or time.monotonic()
        if m.rid in self.live:
            raise InvalidRequest(f"duplicate request id {m.rid!r}")
        m = self.prepare(m)  # a no-op for what the server prepared on its tokenizer thread
        if m.sampling_params.n != 1:
            raise InvalidRequest("a worker takes n=1; the client expands n>1 into separate requests")
        p = m.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens, p.stop, p.no_stop_trim)
        self.live[m.rid] = _Live(m, received, detok)
        assert m.input_ids is not None
        req = Req(m.rid, list(m.input_ids), p, m.return_logprob, m.logprob_start_len, m.top_logprobs_num)
        req.grammar = self.compile_grammar(m, compiled)
        d = m.disagg
        if d is not None and d.role == "decode":
            self.scheduler.validate(req)
            if d.first_token >= 0:
                self._start_decode(req, d.first_token, None)
                return
            landed = self.disagg.expect(req, d)  # PairGone: a 503 (handle)
            if landed is not None:
                self._land(req, landed)
            return
        if d is not None and d.role == "prefill":
            self.disagg.prefilling[m.rid] = d
        self.scheduler.add_request(req)

    def _land(self, req: Req, a: KVArrival) -> None:
        """A decode request's prompt KV and first token arrived: it joins the scheduler there."""
        if a.n_tokens != len(req.input_ids):
            self.live.pop(req.rid)
            raise InvalidRequest(f"the prefill worker computed {a.n_tokens} prompt tokens, this worker has "
                                 f"{len(req.input_ids)} (the workers tokenize differently)")
        self._start_decode(req, a.first_token, None if a.handle else a.kv, a.handle)

    def _start_decode(self, req: Req, first_token: int, kv: Any, handle: int = 0) -> None:
        """Continue a request after its first token (which went out from the prefill worker), from the
        prompt's KV, or with kv None by recomputing it here (as a preempted request is)."""
        live = self.live[req.rid]
        if not 0 <= first_token < self.cfg.vocab_size:
            raise InvalidRequest(f"disagg.first_token must be a token id in [0, {self.cfg.vocab_size})")
        req.output_ids = [first_token]
        if req.grammar is not None:
            req.grammar.accept(first_token)
        if live.detok is not None:
            live.detok.add([first_token], False, None)  # its text went out from the prefill worker
        live.first_token_time = time.monotonic()
        self.scheduler.handoff.add_prefilled(req, kv)
        if handle:  # Adrenaline placement: its KV is on the prefill worker's executor
            d = live.req.disagg
            rc = self.remote_control
            ours = d is not None and d.executor_pairing == rc.pairing and rc.state == "active"
            if not (ours and self.scheduler.remote_residency.adopt(req, handle)):
                logger.warning("request %s: its KV is on executor pairing %s, which is not this worker's in force; "
                               "its prompt is recomputed here", req.rid, d.executor_pairing if d else "?")

    # ---- one iteration ----------------------------------------------------------------------------
    def step(self, inbox: list[ToWorker]) -> list[FromWorker]:
        out: list[FromWorker] = []
        for msg in inbox:
            out.extend(self.handle(msg))
        out.extend(self._disagg_events())
        if self.weights.draining and not self.scheduler.has_work():
            out.extend(self._update_weights())
        t0 = time.perf_counter()
        pre = self.scheduler.prefill_tokens
        prof = self.profiler if self.profiler is not None and self.scheduler.has_work() else None
        if prof is not None:
            prof.before_step()
        results = self.scheduler.step()  # raises on a fatal error (see the module docstring)
        self.remote_control.after_step(self.scheduler)
        if self.local_planning is not None:
            self.local_planning.after_step()
        if prof is not None:
            prof.after_step()
        if self.step_log is not None and (results or self.scheduler.has_work()):
            self.step_log.record(self.scheduler, time.perf_counter() - t0,
                                 sum(len(r.new_token_ids) for r in results), self.scheduler.prefill_tokens - pre)
        if results:
            self.last_step_ms = (time.perf_counter() - t0) * 1e3
            if any(r.new_token_ids and (lv := self.live.get(r.rid)) is not None and lv.first_token_time is not None
                   for r in results):
                self.decode_steps.add(self.last_step_ms / 1e3)
            outs = []
            for r in results:
                handed = False
                if r.rid in self.disagg.prefilling:
                    if r.finished:  # done at its first token (or aborted): nothing goes to the decode worker
                        del self.disagg.prefilling[r.rid]
                    elif r.new_token_ids:
                        err = self.disagg.hand_off(r.rid, r.new_token_ids[0], self.scheduler)
                        if err:
                            self.live.pop(r.rid, None)
                            out.append(ErrorOut(rid=r.rid, message=err, status=503))
                            continue
                        handed = True
                o = self._token_out(r)
                if handed:
                    self.live.pop(r.rid, None)  # the decode worker reports the rest
                if o is not None:
                    outs.append(o)
            if outs:
                out.append(BatchOut(outs=outs))
        return out

    def _update_weights(self) -> list[FromWorker]:
        """Every pending reload, in order (the last that succeeds serves), then the held requests."""
        out: list[FromWorker] = []
        pending, self.weights.pending = self.weights.pending, []
        ok = False
        for m in pending:
            reply = reload(self.runner, self.cfg, m, self.args.random_seed)
            if reply.ok:
                ok, self.weights_path = True, m.model_path
            out.append(reply)
        if ok and not self.scheduler.flush_cache():  # the cached KV is the old weights'
            logger.warning("the prefix cache could not be dropped after a weight update")
        held, self.weights.held = self.weights.held, []
        for g in held:
            out.extend(self.handle(g))
        return out

    def _disagg_events(self, settle_s: float = 0.0) -> list[FromWorker]:
        ready, errors = self.disagg.poll(self.scheduler, settle_s)
        out: list[FromWorker] = list(errors)
        for e in errors:
            self.live.pop(e.rid, None)
        for req, a in ready:
            if req.rid not in self.live:
                continue  # aborted meanwhile
            try:
                self._land(req, a)
            except InvalidRequest as e:
                self.live.pop(req.rid, None)
                out.append(ErrorOut(rid=req.rid, message=str(e), status=500))
        return out

    def aborted(self, rid: str, message: str) -> BatchOut:
        """The end of a request aborted before the scheduler had it (tokenizing, or held for a reload)."""
        meta = {"id": rid, "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0,
                "finish_reason": {"type": "abort", "message": message}}
        return BatchOut(outs=[TokenOut(rid=rid, text_delta="", token_ids=[], finished=True, meta_info=meta)])

    def fatal_errors(self, message: str, also: set[str]) -> list[FromWorker]:
        """An explicit error for every request this worker holds (and `also`), before it exits."""
        return [ErrorOut(rid=rid, message=message, status=FATAL_STATUS) for rid in sorted(set(self.live) | also)]

    def _token_out(self, r: StepOutput) -> TokenOut | None:
        live = self.live.get(r.rid)
        if live is None:
            return None
        now = time.monotonic()
        if r.new_token_ids and live.first_token_time is None:
            live.first_token_time = now
            self.ttft.add(now - live.start, now)
        text = ""
        if live.detok is not None:
            reason = r.finish_reason or {}
            matched = reason.get("matched") if isinstance(reason.get("matched"), str) else None
            text = live.detok.add(r.new_token_ids, r.finished, matched)
        meta: dict[str, Any] = {
            "id": r.rid,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "cached_tokens": r.cached_tokens,
            "attention_executor": r.attention_executor,
            "rotations": r.rotations,
            "finish_reason": r.finish_reason,
            "e2e_latency": now - live.start,
        }
        if live.first_token_time is not None:
            meta["ttft"] = live.first_token_time - live.start
        g = live.req
        if g.return_logprob:
            txt = g.return_text_in_logprobs and self.tokenizer is not None
            meta["input_token_logprobs"] = [self._lp(lp, t, txt) for lp, t in r.input_token_logprobs]
            meta["output_token_logprobs"] = [self._lp(lp, t, txt) for lp, t in r.output_token_logprobs]
            if g.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if row is None else [self._lp(lp, t, txt) for lp, t in row] for row in r.input_top_logprobs
                ]
                meta["output_top_logprobs"] = [[self._lp(lp, t, txt) for lp, t in row] for row in r.output_top_logprobs]
        if r.finished:
            del self.live[r.rid]
            if live.first_token_time is not None and r.completion_tokens > 1:
                tpot = (now - live.first_token_time) / (r.completion_tokens - 1)
                self.tpot.add(tpot)
                if self.local_planning is not None:
                    self.local_planning.request_finished(tpot)
        return TokenOut(rid=r.rid, text_delta=text, token_ids=r.new_token_ids, finished=r.finished, meta_info=meta)

    def _lp(self, lp: float | None, tok: int, with_text: bool) -> list[Any]:
        return [lp, tok, self.tokenizer.token_text(tok) if with_text and self.tokenizer else None]


def _chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text in a chat message list: every value in it (contents, names, tool calls)
    counts, as a template may render any of them. Iterative: nesting depth is the client's choice."""
    n, stack = 0, list[Any]([messages])
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif x is not None:
            n += len(x) if isinstance(x, str) else len(str(x))
    return n
