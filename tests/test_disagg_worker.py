"""Prefill/decode disaggregation at the worker level, without sockets: a prefill `Worker` and a decode
`Worker` in this process (the embedded default model), paired over a real torch.distributed/gloo pair
the way the router pairs them (KVPairOpen to the decode worker, its address to the prefill worker in
KVPairConnect). The test plays the router: it sends each request to both and stitches the outputs.

Greedy outputs equal a plain worker's (prompts that share a prefix included), logprobs and stop
strings continue across the hand-off, and every page is accounted for on both sides after every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_ext.messages import (
    AbortReq,
    BatchOut,
    Disagg,
    ErrorOut,
    FlushCacheReq,
    GenerateReq,
    KVPairClose,
    KVPairConnect,
    KVPairOpen,
    ReplyOut,
)
from sglang_ext.sampling.params import SamplingParams
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.worker import Worker

PROMPTS = ["The weather today is", "The weather today is sunny and the", "Once upon a time, in a land far away",
           "Hi", "A list of fruits: apples, pears, plums, cherries, grapes, and"]


def _args(mode: str | None = None) -> ServerArgs:
    return ServerArgs(device="cpu", dtype="float32", page_size=4, max_total_tokens=4096, chunked_prefill_size=16,
                      disaggregation_mode=mode)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[Worker, Worker, Worker]]:
    ref, p, d = Worker(_args(), "ref"), Worker(_args("prefill"), "p"), Worker(_args("decode"), "d")
    (reply,) = d.handle(KVPairOpen(rid="o", pairing="pair-1", peer="p", peer_device="cpu", timeout_s=10))
    assert isinstance(reply, ReplyOut) and reply.ok, reply
    assert reply.data["backend"] == "gloo"
    p.handle(KVPairConnect(pairing="pair-1", peer="d", store=reply.data["store"], backend="gloo", timeout_s=10))
    yield ref, p, d
    p.disagg.close()
    d.disagg.close()


def _sp(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def _run_plain(w: Worker, reqs: list[GenerateReq]) -> dict[str, dict[str, Any]]:
    res: dict[str, dict[str, Any]] = {r.rid: {"ids": [], "text": "", "meta": {}} for r in reqs}
    out = w.step(list(reqs))
    while True:
        for m in out:
            assert isinstance(m, BatchOut), m
            for o in m.outs:
                _fold(res[o.rid], o)
        if all(r.get("done") for r in res.values()):
            return res
        out = w.step([])


def _fold(acc: dict[str, Any], o: Any) -> None:
    acc["ids"] += o.token_ids
    acc["text"] += o.text_delta
    for k in ("output_token_logprobs", "input_token_logprobs"):
        if k in o.meta_info:
            acc.setdefault(k, []).extend(o.meta_info[k])
    acc["meta"].update({k: v for k, v in o.meta_info.items() if not k.endswith("logprobs")})
    acc["done"] = o.finished


def _run_pd(p: Worker, d: Worker, reqs: list[GenerateReq], room0: int,
            abort_after: dict[str, int] | None = None) -> tuple[dict[str, dict[str, Any]], list[ErrorOut]]:
    """Each request to both workers (as the router sends it); both stepped until all finished."""
    res: dict[str, dict[str, Any]] = {r.rid: {"ids": [], "text": "", "meta": {}} for r in reqs}
    errors: list[ErrorOut] = []
    p_in = [GenerateReq(**{**_fields(r), "disagg": Disagg(role="prefill", pairing="pair-1", room=room0 + i)})
            for i, r in enumerate(reqs)]
    d_in: list[Any] = [GenerateReq(**{**_fields(r), "disagg": Disagg(role="decode", pairing="pair-1", room=room0 + i)})
                       for i, r in enumerate(reqs)]
    deadline = time.monotonic() + 60
    while not all(r.get("done") for r in res.values()):
        assert time.monotonic() < deadline, res
        from_p = p.step(p_in)
        out = from_p + d.step(d_in)
        p_in, d_in = [], []
        p.scheduler.check()
        d.scheduler.check()
        for m in from_p:  # done on the prefill worker (at its first token): the decode worker drops it
            if isinstance(m, BatchOut):
                d_in += [AbortReq(rid=o.rid) for o in m.outs if o.finished]
        for m in out:
            if isinstance(m, ErrorOut):
                errors.append(m)
                res[m.rid]["done"] = True
                continue
            assert isinstance(m, BatchOut), m
            for o in m.outs:
                if not res[o.rid].get("done"):
                    _fold(res[o.rid], o)
                    n = (abort_after or {}).get(o.rid)
                    if n is not None and len(res[o.rid]["ids"]) >= n:
                        d_in.append(AbortReq(rid=o.rid))
                        p_in.append(AbortReq(rid=o.rid))
                        res[o.rid]["done"] = True
        if not out:
            time.sleep(0.002)  # a transfer in flight on the pair's threads
    return res, errors


def _fields(r: GenerateReq) -> dict[str, Any]:
    return {f: getattr(r, f) for f in r.__struct_fields__}


def _drain(p: Worker, d: Worker) -> None:
    """Let sends finish and their pages come back."""
    deadline = time.monotonic() + 10
    while p.scheduler.handoff.handing or p.disagg.sending:
        assert time.monotonic() < deadline
        p.step([])
        time.sleep(0.002)
    p.scheduler.check()
    d.scheduler.check()


def test_greedy_outputs_equal_a_plain_worker(workers: tuple[Worker, Worker, Worker]) -> None:
    ref, p, d = workers
    reqs = [GenerateReq(rid=f"g{i}", text=t, sampling_params=_sp(12, ignore_eos=True)) for i, t in enumerate(PROMPTS)]
    want = _run_plain(ref, reqs)
    got, errors = _run_pd(p, d, reqs, 100)
    assert not errors
    for r in reqs:
        assert got[r.rid]["ids"] == want[r.rid]["ids"]
        assert got[r.rid]["text"] == want[r.rid]["text"]
        assert got[r.rid]["meta"]["completion_tokens"] == 12
    _drain(p, d)
    sent, got = p.disagg.counts, d.disagg.counts
    assert sent.transfers_out == got.transfers_in == len(reqs)
    assert sent.bytes_out == got.bytes_in > 0
    rep = p.load_report().disagg
    assert rep is not None and rep.transfers_out == len(reqs) and rep.bytes_out == sent.bytes_out
    # Latency for the planners: first tokens are the prefill worker's (TTFT), the rest the decode worker's.
    rp, rd = p.load_report().latency, d.load_report().latency
    assert rp.ttft_samples == len(reqs) and rp.ttft_p99_ms > 0 and rp.tpot_samples == 0
    assert rd.ttft_samples == 0 and rd.tpot_samples == len(reqs) and rd.tpot_p99_ms > 0
    # ... and the decode steps (what adaptive keeps a sender's steps within) are the decode worker's only
    assert rp.decode_steps == 0 and rp.decode_step_ms == 0.0
    assert rd.decode_steps > 0 and rd.decode_step_ms > 0
    # The prefill worker's prefix cache holds the prompts now: a repeat hits it, outputs unchanged.
    again, _ = _run_pd(p, d, reqs[:2], 200)
    assert [again[r.rid]["ids"] for r in reqs[:2]] == [want[r.rid]["ids"] for r in reqs[:2]]
    _drain(p, d)
    assert p.scheduler.kv.cache.size_info().cached_pages > 0
    assert not d.disagg.expecting and not d.disagg.arrived


def test_logprobs_and_stop_strings_across_the_hand_off(workers: tuple[Worker, Worker, Worker]) -> None:
    ref, p, d = workers
    base = _run_plain(ref, [GenerateReq(rid="s0", text=PROMPTS[2], sampling_params=_sp(10, ignore_eos=True))])
    stop = base["s0"]["text"][3:6]  # text of a later token: the decode worker must find it
    reqs = [GenerateReq(rid="lp", text=PROMPTS[4], sampling_params=_sp(6, ignore_eos=True), return_logprob=True,
                        logprob_start_len=2),
            GenerateReq(rid="st", text=PROMPTS[2], sampling_params=_sp(10, ignore_eos=True, stop=[stop]))]
    want = _run_plain(ref, [GenerateReq(**{**_fields(r), "rid": r.rid + "-ref"}) for r in reqs])
    got, errors = _run_pd(p, d, reqs, 300)
    assert not errors
    for r in reqs:
        w = want[r.rid + "-ref"]
        assert got[r.rid]["ids"] == w["ids"] and got[r.rid]["text"] == w["text"]
        assert got[r.rid]["meta"]["finish_reason"] == w["meta"]["finish_reason"]
    lp, wlp = got["lp"], want["lp-ref"]
    assert [t for _, t, _ in lp["output_token_logprobs"]] == [t for _, t, _ in wlp["output_token_logprobs"]]
    want_lp = [x for x, _, _ in wlp["output_token_logprobs"]]
    assert [x for x, _, _ in lp["output_token_logprobs"]] == pytest.approx(want_lp)
    assert [t for _, t, _ in lp["input_token_logprobs"]] == [t for _, t, _ in wlp["input_token_logprobs"]]
    _drain(p, d)


def test_seeded_sampling_and_penalties_continue_across_the_hand_off(workers: tuple[Worker, Worker, Worker]) -> None:
    """The decode worker draws token k with the request's seed at position k, and its penalty table
    and min_new_tokens count the first token: seeded outputs equal the plain worker's."""
    ref, p, d = workers
    sps = [SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
           SamplingParams(max_new_tokens=12, temperature=0.7, seed=3, frequency_penalty=0.8, presence_penalty=0.3,
                          repetition_penalty=1.3),
           SamplingParams(max_new_tokens=12, temperature=0.0, min_new_tokens=8, repetition_penalty=1.5)]
    reqs = [GenerateReq(rid=f"z{i}", text=PROMPTS[i], sampling_params=sp) for i, sp in enumerate(sps)]
    want = _run_plain(ref, [GenerateReq(**{**_fields(r), "rid": r.rid + "-ref"}) for r in reqs])
    got, errors = _run_pd(p, d, reqs, 500)
    assert not errors
    for r in reqs:
        assert got[r.rid]["ids"] == want[r.rid + "-ref"]["ids"] and got[r.rid]["text"] == want[r.rid + "-ref"]["text"]
    _drain(p, d)


def test_resumed_without_kv_recomputes_the_prompt(workers: tuple[Worker, Worker, Worker]) -> None:
    """`disagg.first_token` (the prefill worker's KV will never come): the decode worker recomputes the
    prompt and continues after that token with the plain worker's outputs."""
    ref, _, d = workers
    sp = _sp(10, ignore_eos=True)
    want = _run_plain(ref, [GenerateReq(rid="r-ref", text=PROMPTS[4], sampling_params=sp, return_logprob=True)])
    first_text = _run_plain(ref, [GenerateReq(rid="r1", text=PROMPTS[4], sampling_params=_sp(1))])["r1"]["text"]
    got = _run_plain(d, [GenerateReq(rid="r", text=PROMPTS[4], sampling_params=sp, return_logprob=True, disagg=Disagg(
        role="decode", pairing="", room=0, first_token=want["r-ref"]["ids"][0]))])["r"]
    assert got["ids"] == want["r-ref"]["ids"][1:]
    assert first_text + got["text"] == want["r-ref"]["text"]
    lps, want_lps = got["output_token_logprobs"], want["r-ref"]["output_token_logprobs"][1:]
    assert [t for _, t, _ in lps] == [t for _, t, _ in want_lps]
    assert [x for x, _, _ in lps] == pytest.approx([x for x, _, _ in want_lps], abs=1e-4)
    assert not got.get("input_token_logprobs")  # the prefill worker reported those
    d.scheduler.check()


def test_cache_flush_right_after_a_hand_off(workers: tuple[Worker, Worker, Worker]) -> None:
    """The client has its first token (and may have all of it) while the prefill worker's send is still
    in flight: a cache flush then waits for the send to complete instead of being refused."""
    ref, p, d = workers
    want = _run_plain(ref, [GenerateReq(rid="f-ref", text=PROMPTS[0], sampling_params=_sp(6))])["f-ref"]["ids"]
    dis = Disagg(role="decode", pairing="pair-1", room=600)
    assert d.step([GenerateReq(rid="f", text=PROMPTS[0], sampling_params=_sp(6), disagg=dis)]) == []
    out = p.step([GenerateReq(rid="f", text=PROMPTS[0], sampling_params=_sp(6),
                              disagg=Disagg(role="prefill", pairing="pair-1", room=600))])
    while not out:
        out = p.step([])
    assert isinstance(out[0], BatchOut) and out[0].outs[0].token_ids == want[:1]
    replies = [m for m in p.handle(FlushCacheReq(rid="flush")) if isinstance(m, ReplyOut)]
    assert replies == [ReplyOut(rid="flush", ok=True)] and not p.scheduler.handoff.handing
    assert p.scheduler.kv.cache.size_info().cached_pages == 0
    ids: list[int] = []
    deadline = time.monotonic() + 30
    while len(ids) < len(want) - 1:
        assert time.monotonic() < deadline
        for m in d.step([]):
            assert isinstance(m, BatchOut), m
            ids += [t for o in m.outs for t in o.token_ids]
        time.sleep(0.002)
    assert want[:1] + ids == want
    p.scheduler.check()
    d.scheduler.check()


def test_abort_on_both_sides(workers: tuple[Worker, Worker, Worker]) -> None:
    _, p, d = workers
    reqs = [GenerateReq(rid=f"a{i}", text=t, sampling_params=_sp(40, ignore_eos=True))
            for i, t in enumerate(PROMPTS[:3])]
    got, errors = _run_pd(p, d, reqs, 400, abort_after={"a0": 1, "a1": 5})
    assert not errors and got["a2"]["meta"]["completion_tokens"] == 40
    _drain(p, d)
    for _ in range(3):
        d.step([])
    assert not d.scheduler.running and not d.scheduler.waiting and not d.disagg.expecting
    d.scheduler.check()
    p.scheduler.check()


def test_a_pair_that_is_gone_fails_explicitly(workers: tuple[Worker, Worker, Worker]) -> None:
    """Decode side: a request for a pairing this worker does not have is refused at once. Prefill
    side: a request whose pairing is not connected fails at its hand-off with an explicit error."""
    _, p, d = workers
    (err,) = d.handle(GenerateReq(rid="x", text="Hi", sampling_params=_sp(3),
                                  disagg=Disagg(role="decode", pairing="nope", room=1)))
    assert isinstance(err, ErrorOut) and err.status == 503 and "no KV pair nope" in err.message
    assert ("nope", 1) in d.disagg.dropped  # its KV, should it come, is not kept
    out = p.step([GenerateReq(rid="y", text="Hi", sampling_params=_sp(3),
                              disagg=Disagg(role="prefill", pairing="nope", room=1))])
    while not out:
        out = p.step([])
    assert isinstance(out[0], ErrorOut) and out[0].status == 503 and "cannot send KV" in out[0].message
    p.scheduler.check()
    assert not p.scheduler.running and "y" not in p.live


def test_the_router_closes_a_pair_whose_prefill_worker_is_down(workers: tuple[Worker, Worker, Worker]) -> None:
    """A hung prefill worker keeps its sockets open: the router's KVPairClose fails the requests still
    waiting for its KV at once (here the prefill side never even connected)."""
    _, _, d = workers
    (reply,) = d.handle(KVPairOpen(rid="o2", pairing="pair-2", peer="hung", peer_device="cpu", timeout_s=10))
    assert isinstance(reply, ReplyOut) and reply.ok
    assert d.step([GenerateReq(rid="h", text="Hi", sampling_params=_sp(3),
                               disagg=Disagg(role="decode", pairing="pair-2", room=1))]) == []
    out = d.step([KVPairClose(pairing="pair-2")])
    while not out:
        out = d.step([])
    (err,) = out
    assert isinstance(err, ErrorOut) and err.rid == "h" and err.status == 503 and "hung is down" in err.message
    assert "pair-2" not in d.disagg.receivers and not d.disagg.expecting
    d.scheduler.check()


def test_requests_waiting_for_kv_fail_when_the_pair_closes(workers: tuple[Worker, Worker, Worker]) -> None:
    """The prefill side goes away (here: closes the pair; a dead process closes its sockets the same
    way): a decode request still waiting for its KV fails with an explicit 503 at once. (Last: it
    ends the module's pair.)"""
    _, p, d = workers
    assert d.step([GenerateReq(rid="w", text="Hi", sampling_params=_sp(3),
                               disagg=Disagg(role="decode", pairing="pair-1", room=999))]) == []
    assert d.disagg.expecting
    p.disagg.connect(KVPairConnect(pairing="pair-1", peer="d", close=True))
    deadline = time.monotonic() + 10
    out: list[Any] = []
    while not out:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        out = d.step([])
    (err,) = out
    assert isinstance(err, ErrorOut) and err.rid == "w" and err.status == 503 and "never arrived" in err.message
    assert not d.disagg.expecting and "w" not in d.live and "pair-1" not in d.disagg.receivers
    d.scheduler.check()
