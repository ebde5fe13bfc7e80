"""Structured output in the scheduler, on the embedded default model: its weights are random, so its
unconstrained text is gibberish and only the grammar can make an output match. Every constrained output
must match its regex / validate against its schema, across prompts, seeds, batching, chunked prefill,
the prefix cache, preemption (recompute and rotation) and the overlap loop; unconstrained rows next to
constrained ones must come out exactly as alone."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from _offload_util import force_drop

from sglang_ext.engine.model_runner import ModelRunner
from sglang_ext.grammar.backend import Constraint, GrammarBackend, constraint_of
from sglang_ext.grammar.masks import GrammarMasks
from sglang_ext.models.config import ModelConfig
from sglang_ext.models.default_model import ensure_default_model
from sglang_ext.offload.setup import local_sender
from sglang_ext.sampling.params import InvalidRequest, SamplingParams
from sglang_ext.scheduler.request import Req
from sglang_ext.scheduler.scheduler import Scheduler
from sglang_ext.server_args import ServerArgs
from sglang_ext.worker.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
REGEXES = [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,6} [0-9]{1,2}\.[0-9]{2}",
           r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"},  # not maxLength: see docs/api.md
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@dataclass
class Env:
    dir: Path
    cfg: ModelConfig
    tok: Tokenizer
    eos: frozenset[int]
    grammars: GrammarBackend

    def scheduler(self, overlap: bool = False, max_total_tokens: int = 8192, **args: Any) -> Scheduler:
        sa = ServerArgs(device="cpu", dtype="float32", page_size=4, max_total_tokens=max_total_tokens, **args)
        runner = ModelRunner(sa, self.dir, self.cfg)
        return Scheduler(sa, runner, 4, self.eos, decode_fn=lambda ids: self.tok.decode(ids, False),
                         vocab_size=self.cfg.vocab_size, remote_sender=local_sender(sa, runner, "emb"), overlap=overlap)

    def req(self, rid: str, prompt: str, kind: str | None = None, text: str | None = None, **sp: Any) -> Req:
        sp.setdefault("max_new_tokens", 64)
        params = SamplingParams(**sp, **({kind: text} if kind else {}))
        r = Req(rid, self.tok.encode(prompt), params)
        if kind is not None:
            assert text is not None
            r.grammar = self.grammars.state(self.grammars.compile(Constraint(kind, text)))
        return r

    def text(self, r: Req) -> str:
        return self.tok.decode(r.output_ids, True)  # the final stop token is special: not in the text


@pytest.fixture(scope="module")
def env() -> Env:
    d = ensure_default_model()
    cfg = ModelConfig.from_path(d)
    tok = Tokenizer.from_dir(d)
    eos = frozenset(cfg.eos_token_ids) | tok.eos_ids
    # Compact JSON (constrained_json_disable_any_whitespace): a random model fills free whitespace
    # with anything, so outputs would be long; the default is tested on its own below.
    return Env(d, cfg, tok, eos, GrammarBackend(tok.hf, cfg.vocab_size, eos, any_whitespace=False))


def run(s: Scheduler, reqs: list[Req]) -> dict[str, list[int]]:
    for r in reqs:
        s.add_request(r)
    for _ in range(5000):
        if not s.has_work():
            break
        s.step()
        s.check()
    assert not s.has_work()
    return {r.rid: list(r.output_ids) for r in reqs}


def _mixed(env: Env, tag: str = "") -> list[Req]:
    """Constrained (regex, schema; greedy and seeded) and unconstrained rows."""
    schema = json.dumps(SCHEMA)
    out = []
    for i in range(8):
        kind, text = ("regex", REGEXES[i % 4]) if i % 2 == 0 else ("json_schema", schema)
        sp = {"temperature": 0.0} if i < 4 else {"temperature": 1.0, "seed": 7 + i}
        out.append(env.req(f"c{i}{tag}", f"Record {i}: the answer is", kind, text, max_new_tokens=56, **sp))
    out.append(env.req(f"u0{tag}", "Once upon a time", max_new_tokens=12, temperature=0.0, ignore_eos=True))
    out.append(env.req(f"u1{tag}", "A long story", max_new_tokens=12, temperature=0.9, seed=3, ignore_eos=True))
    return out


def _check_valid(env: Env, reqs: list[Req]) -> None:
    for r in reqs:
        p = r.sampling
        if p.regex is None and p.json_schema is None:
            continue
        assert r.finish_reason is not None and r.finish_reason.type == "stop", (r.rid, r.finish_reason)
        assert r.output_ids[-1] in env.eos
        if p.regex is not None:
            assert re.fullmatch(p.regex, env.text(r)), (r.rid, p.regex, env.text(r))
        else:
            jsonschema.validate(json.loads(env.text(r)), json.loads(p.json_schema or ""))


def test_regex_outputs_match(env: Env) -> None:
    reqs = [env.req(f"r{i}", f"Prompt number {i * 37}:", "regex", REGEXES[i % len(REGEXES)], max_new_tokens=64,
                    **({"temperature": 0.0} if i < 4 else {"temperature": 1.0, "seed": 100 + i}))
            for i in range(16)]
    run(env.scheduler(), reqs)
    _check_valid(env, reqs)
    assert len({env.text(r) for r in reqs}) > 8  # seeds and prompts really vary the outputs


def test_json_schema_outputs_validate(env: Env) -> None:
    schema = json.dumps(SCHEMA)
    reqs = [env.req(f"j{i}", f"Person {i}:", "json_schema", schema, max_new_tokens=128,
                    **({"temperature": 0.0} if i < 2 else {"temperature": 1.0, "top_p": 0.95, "seed": 40 + i}))
            for i in range(10)]
    run(env.scheduler(), reqs)
    _check_valid(env, reqs)
    assert len({env.text(r) for r in reqs}) > 5


def test_json_schema_with_free_whitespace(env: Env) -> None:
    """SGLang's default: whitespace anywhere JSON allows it."""
    free = GrammarBackend(env.tok.hf, env.cfg.vocab_size, env.eos)
    reqs = [env.req("w", "Person 0:", max_new_tokens=160, temperature=0.0)]
    for r in reqs:
        r.sampling.json_schema = json.dumps(SCHEMA)
        r.grammar = free.state(free.compile(Constraint("json_schema", r.sampling.json_schema)))
    run(env.scheduler(), reqs)
    _check_valid(env, reqs)
    assert any(re.search(r"\s\s", env.text(r)) for r in reqs)


def test_ebnf_and_structural_tag(env: Env) -> None:
    ebnf = 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?'
    tag = json.dumps({"structures": [{"begin": "<call>", "schema": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"], "additionalProperties": False},
        "end": "</call>"}], "triggers": ["<call>"]})
    reqs = [env.req(f"e{i}", f"Sum {i}:", "ebnf", ebnf, temperature=1.0, seed=i) for i in range(6)]
    call = env.req("tag", "Tool:", "structural_tag", tag, max_new_tokens=24, temperature=0.0)
    run(env.scheduler(), [*reqs, call])
    for r in reqs:
        assert r.finish_reason is not None and r.finish_reason.type == "stop"
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", env.text(r)), env.text(r)
    # Free text until a trigger; after "<call>" only the schema and "</call>" may follow.
    text = env.text(call)
    for m in re.finditer(r"<call>", text):
        body = re.match(r"<call>(.*?)</call>", text[m.start():], re.S)
        assert body is not None or len(call.output_ids) == 24, text
        if body is not None:
            jsonschema.validate(json.loads(body.group(1)), {"type": "object", "required": ["x"]})


@pytest.fixture(scope="module")
def mixed_ref(env: Env) -> dict[str, list[int]]:
    """The mixed batch with the plain loop, no chunking pressure, a large pool."""
    reqs = _mixed(env)
    out = run(env.scheduler(), reqs)
    _check_valid(env, reqs)
    return out


def test_rows_equal_alone(env: Env, mixed_ref: dict[str, list[int]]) -> None:
    """Unconstrained rows next to constrained ones come out exactly as alone; a constrained row's tokens
    depend on its own logits and matcher only (greedy and seeded)."""
    for r in _mixed(env, "-alone"):
        if r.rid in ("u0-alone", "u1-alone", "c0-alone", "c5-alone"):
            assert run(env.scheduler(), [r])[r.rid] == mixed_ref[r.rid.removesuffix("-alone")], r.rid


@pytest.mark.parametrize("setup", [
    pytest.param({"max_total_tokens": 72, "chunked_prefill_size": 8}, id="preempt-recompute"),
    pytest.param({"max_total_tokens": 72, "chunked_prefill_size": 8, "preemption_mode": "rotate"},
                 id="preempt-rotate"),
    pytest.param({"chunked_prefill_size": 5}, id="chunked"),
    pytest.param({"overlap": True}, id="overlap"),
    pytest.param({"overlap": True, "disable_grammar_overlap": True}, id="overlap-drained"),
    pytest.param({"overlap": True, "max_total_tokens": 72, "chunked_prefill_size": 8},
                 id="overlap-preempt"),
    pytest.param({"overlap": True, "chunked_prefill_size": 5}, id="overlap-chunked"),
    pytest.param({"overlap": True, "max_total_tokens": 72, "chunked_prefill_size": 8,
                  "preemption_mode": "rotate"}, id="overlap-rotate"),
])
def test_outputs_survive_scheduling(env: Env, mixed_ref: dict[str, list[int]], setup: dict[str, Any]) -> None:
    """Matcher state follows its request through chunking, preemption (its kept tokens are never fed
    to the matcher again), rotation (the matcher is on the request) and the overlap loop (constrained
    rows overlapped, or drained with disable_grammar_overlap); outputs are unchanged."""
    s = env.scheduler(**setup)
    reqs = _mixed(env)
    assert run(s, reqs) == mixed_ref
    _check_valid(env, reqs)
    _check_matchers(env, reqs)
    if setup.get("preemption_mode") == "rotate":
        assert sum(r.rotations for r in reqs) > 0
    elif "max_total_tokens" in setup:
        assert s.num_preemptions > 0
    if s.overlap is not None:
        # Overlapped: steps with constrained rows are launched before their predecessor lands.
        # Drained: only the steps after every constrained row has finished overlap.
        drained = setup.get("disable_grammar_overlap", False)
        assert (s.overlap.grammar_overlapped_steps == 0) if drained else (s.overlap.grammar_overlapped_steps > 10)


def _check_matchers(env: Env, reqs: list[Req]) -> None:
    """Each matcher has taken exactly its request's output tokens (never a dropped one): a fresh
    matcher fed them ends in the same state (ended, or the same next-token mask)."""
    masks = GrammarMasks(env.cfg.vocab_size, "cpu")
    for r in reqs:
        c = constraint_of(r.sampling)
        if c is None or r.grammar is None:
            continue
        fresh = env.grammars.state(env.grammars.compile(c))
        for t in r.output_ids:
            fresh.accept(t)
        assert fresh.error is None and r.grammar.error is None, r.rid
        assert fresh.terminated == r.grammar.terminated, r.rid
        if not fresh.terminated:
            assert torch.equal(masks.fill([fresh]), masks.fill([r.grammar])), r.rid


def _finishes(env: Env, tag: str, stop: int) -> list[Req]:
    """Rows that finish every way while the step after theirs is in flight: grammar end (EOS), length
    with the grammar unfinished, a stop string and a stop token mid-grammar, and unconstrained rows
    by length and by a stop token (the EOS rule's twin); greedy and seeded."""
    return [
        env.req(f"end{tag}", "Answer:", "regex", "(yes|no|maybe)", temperature=0.0),
        env.req(f"len{tag}", "Letters:", "regex", "[a-z]{40}", max_new_tokens=5, temperature=1.0, seed=3),
        env.req(f"sstr{tag}", "Code:", "regex", "[0-9]{3}-[a-z]{2,5}", stop=["-"], temperature=0.0),
        env.req(f"stok{tag}", "Plain:", max_new_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
        env.req(f"json{tag}", "Person:", "json_schema", json.dumps(SCHEMA), max_new_tokens=96, temperature=1.0,
                seed=11),
        env.req(f"free{tag}", "Free text", max_new_tokens=9, temperature=0.7, seed=5, ignore_eos=True),
    ]


def test_overlap_finishes_every_way(env: Env) -> None:
    """Greedy and seeded outputs and finish reasons of the overlap loop (constrained rows overlapped,
    or drained) equal the plain loop's, whichever way a row finishes."""
    stop = run(env.scheduler(), [env.req("probe", "Plain:", max_new_tokens=8, temperature=0.0,
                                         ignore_eos=True)])["probe"][5]
    results = []
    for setup in ({}, {"overlap": True}, {"overlap": True, "disable_grammar_overlap": True}):
        reqs = _finishes(env, "", stop)
        s = env.scheduler(**setup)
        out = run(s, reqs)
        _check_matchers(env, reqs)
        results.append((out, [r.finish_reason.to_dict() if r.finish_reason else None for r in reqs]))
    assert results[1] == results[0] and results[2] == results[0]
    reasons = {r["type"] + str(r.get("matched", "")) for r in results[0][1] if r}
    assert {"length", "stop-", f"stop{stop}"} <= reasons and len(results[0][0]["stok"]) < 30
    assert results[0][1][0] == {"type": "stop", "matched": results[0][0]["end"][-1]}


@pytest.mark.parametrize("after_steps", [2, 5])
def test_overlap_aborts_in_flight(env: Env, mixed_ref: dict[str, list[int]], after_steps: int) -> None:
    """Aborts while a constrained step is in flight: the aborted rows' dropped tokens never reach their
    matchers, the others come out as without aborts, and every page comes back."""
    s = env.scheduler(True, disable_radix_cache=True)
    reqs = _mixed(env)
    for r in reqs:
        s.add_request(r)
    for _ in range(after_steps):
        s.step()
        s.check()
    gone = reqs[1::3]
    assert s.overlap is not None and s.overlap.inflight is not None and all(s.abort(r.rid) for r in gone)
    run(s, [])
    for r in reqs:
        if r in gone:
            assert r.finish_reason is not None and r.finish_reason.type == "abort"
        else:
            assert r.output_ids == mixed_ref[r.rid], r.rid
    _check_matchers(env, reqs)
    assert s.allocator.num_free == s.allocator.capacity


def test_prefix_cache_hits(env: Env, mixed_ref: dict[str, list[int]]) -> None:
    s = env.scheduler()
    warm = _mixed(env, "-warm")
    for r in warm:  # the same prompts, one unconstrained token each: their pages go to the cache
        r.sampling, r.grammar = SamplingParams(max_new_tokens=1), None
    run(s, warm)
    again = _mixed(env)
    assert run(s, again) == mixed_ref
    assert sum(r.cached_tokens for r in again) > 0


def test_length_when_the_grammar_cannot_finish(env: Env) -> None:
    r = env.req("short", "Letters:", "regex", "[a-z]{40}", max_new_tokens=3, temperature=0.0)
    run(env.scheduler(), [r])
    assert r.finish_reason is not None and r.finish_reason.to_dict() == {"type": "length", "length": 3}
    assert re.fullmatch("[a-z]+", env.text(r)) and len(env.text(r)) < 40


def test_grammar_end_stops_even_with_ignore_eos(env: Env) -> None:
    r = env.req("ign", "Answer:", "regex", "(yes|no)", ignore_eos=True, temperature=0.0)
    run(env.scheduler(), [r])
    assert r.finish_reason is not None and r.finish_reason.type == "stop"
    assert env.text(r) in ("yes", "no")


def test_min_new_tokens_holds_back_the_end(env: Env) -> None:
    reqs = [env.req(f"m{i}", f"Digits {i}:", "regex", "[0-9]{1,40}", min_new_tokens=4, temperature=1.0, seed=i)
            for i in range(4)]
    run(env.scheduler(), reqs)
    for r in reqs:
        assert len(r.output_ids) >= 5 and re.fullmatch("[0-9]{1,40}", env.text(r)), env.text(r)


def test_logprobs_are_of_the_masked_distribution(env: Env) -> None:
    choices = ("yes", "no", "maybe")
    r = env.req("lp", "Answer:", "regex", "(yes|no|maybe)", temperature=0.0)
    r.return_logprob, r.top_logprobs_num = True, 8
    run(env.scheduler(), [r])
    first = r.output_top_logprobs[0]
    allowed = [(lp, t) for lp, t in first if lp != -math.inf]
    assert allowed and all(any(c.startswith(env.tok.decode([t])) for c in choices) for _, t in allowed)
    assert math.isclose(sum(math.exp(lp) for lp, _ in allowed), 1.0, rel_tol=1e-3) or len(allowed) == 8
    assert all(lp <= 0.0 and lp != -math.inf for lp, _ in r.output_token_logprobs)


def test_invalid_constraints_name_the_problem(env: Env) -> None:
    for kind, text, needle in [("regex", "[0-9", "Unclosed"), ("json_schema", '{"type": "objectx"}', "objectx"),
                               ("ebnf", "root ::= foo", "foo"), ("structural_tag", '{"structures": 3}', "")]:
        with pytest.raises(InvalidRequest, match=f"sampling_params.{kind} is not valid: .*{re.escape(needle)}"):
            env.grammars.compile(Constraint(kind, text))
    with pytest.raises(InvalidRequest, match="at most one of"):
        SamplingParams(regex="a", json_schema="{}").validate()
    with pytest.raises(InvalidRequest, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{nope").validate()
    with pytest.raises(InvalidRequest, match="regex must not be empty"):
        SamplingParams(regex=" ").validate()


def test_compiled_grammars_are_cached(env: Env) -> None:
    c = Constraint("regex", "[a-c]{2}")
    assert env.grammars.compile(c) is env.grammars.compile(c)
    a, b = env.grammars.state(env.grammars.compile(c)), env.grammars.state(env.grammars.compile(c))
    a.accept(env.tok.encode("a")[-1])
    assert a.matcher is not b.matcher and not b.terminated


def test_xgrammar_is_imported_only_when_needed() -> None:
    code = ("import sys; from sglang_ext.worker.worker import Worker; from sglang_ext.worker.server import "
            "WorkerServer; from sglang_ext.scheduler.scheduler import Scheduler; "
            "w = Worker.__new__(Worker); print('xgrammar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr



def test_overlap_remote_rows_taken_back_in_flight(env: Env, mixed_ref: dict[str, list[int]]) -> None:
    """Constrained remote rows (attention on an in-process executor) overlap too. Rows the executor
    drops while their step-t token is in flight keep that token, in their matcher as well: one whose
    token ends its grammar finishes from the queue, one mid-grammar is recomputed and goes on."""
    s = env.scheduler(True, offload_executor="local", offload_ratio=1.0)
    last = {"c2": len(mixed_ref["c2"]) - 1, "c1": 9}  # c2: its final token (EOS) is in flight
    dropped = force_drop(s, lambda reqs: [r for r in reqs
                                          if last.get(r.rid) == len(r.output_ids) and r.rid not in dropped])
    reqs = _mixed(env)
    assert run(s, reqs) == mixed_ref
    _check_valid(env, reqs)
    _check_matchers(env, reqs)
    assert sorted(dropped) == ["c1", "c2"] and s.overlap.grammar_overlapped_steps > 10
    assert reqs[2].finish_reason is not None and reqs[2].finish_reason.type == "stop" and s.num_preemptions == 2
