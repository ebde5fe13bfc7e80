"""Streaming HTTP clients for ``bench/serving.py``: SGLang ``/generate`` and OpenAI ``/v1/completions``.

Both send token-id prompts and ``ignore_eos`` so the output length is fixed by the workload. A token
arrival is recorded whenever the stream's completion-token count grows; every such chunk contributes
one ITL value (the gap since the previous token chunk), even if it carries several tokens.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aiohttp

from bench.metrics import RequestResult
from bench.traces import RequestSpec

BACKENDS = ("sglang", "openai")
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class StreamError(RuntimeError):
    """The server reported an error inside an otherwise successful HTTP response."""


@dataclass(frozen=True)
class BackendConfig:
    backend: str = "sglang"
    base_url: str = "http://127.0.0.1:30000"
    api_key: str | None = None
    request_timeout_s: float = 300.0


def is_loopback_url(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_base_url(url: str, allow_remote: bool) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--base-url must be an http(s) URL, got {url!r}")
    if not allow_remote and not is_loopback_url(url):
        raise ValueError(f"refusing non-loopback host {parsed.hostname!r}; pass --allow-remote to target it")


def build_request(cfg: BackendConfig, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
    base = cfg.base_url.rstrip("/")
    if cfg.backend == "openai":
        return f"{base}/v1/completions", {
            "model": spec.model or "default",
            "prompt": spec.input_ids,
            "max_tokens": spec.output_len,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    payload: dict[str, Any] = {
        "input_ids": spec.input_ids,
        "sampling_params": {"max_new_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    if spec.model is not None:
        payload["model"] = spec.model
    return f"{base}/generate", payload


def headers(cfg: BackendConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def iter_sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Yield the payload of every ``data:`` line; tolerant of arbitrarily long lines and CRLF."""
    buf = b""
    async for piece in resp.content.iter_any():
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            text = line.strip()
            if text.startswith(b"data:"):
                yield text[5:].strip().decode("utf-8", errors="replace")
    tail = buf.strip()
    if tail.startswith(b"data:"):
        yield tail[5:].strip().decode("utf-8", errors="replace")


class StreamTracker:
    """Turns cumulative token counts into TTFT / ITL / chunk records on a ``RequestResult``."""

    def __init__(self, result: RequestResult, start: float, bench_t0: float) -> None:
        self.result, self.start, self.bench_t0 = result, start, bench_t0
        self.last_token_time: float | None = None

    def observe(self, total_tokens: int, now: float) -> None:
        new = total_tokens - self.result.output_tokens
        if new <= 0:
            return
        if self.last_token_time is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.itls_s.append(now - self.last_token_time)
        self.last_token_time = now
        self.result.output_tokens = total_tokens
        self.result.chunk_times_s.append(now - self.bench_t0)
        self.result.chunk_tokens.append(new)


def _raise_on_error(chunk: dict[str, Any]) -> None:
    err = chunk.get("error")
    if err:
        raise StreamError(str(err.get("message", err) if isinstance(err, dict) else err)[:300])


def handle_sglang_chunk(chunk: dict[str, Any], tracker: StreamTracker, now: float) -> None:
    _raise_on_error(chunk)
    meta = chunk.get("meta_info") or {}
    count = meta.get("completion_tokens")
    if count is None:
        count = len(chunk.get("output_ids") or [])
    if meta.get("prompt_tokens"):
        tracker.result.input_len = int(meta["prompt_tokens"])
    if meta.get("cached_tokens") is not None:
        tracker.result.cached_tokens = int(meta["cached_tokens"])
    if meta.get("ttft") is not None and tracker.result.server_ttft_s is None:
        tracker.result.server_ttft_s = float(meta["ttft"])
    if meta.get("e2e_latency") is not None:
        tracker.result.server_e2e_s = float(meta["e2e_latency"])
    tracker.observe(int(count), now)


def handle_openai_chunk(chunk: dict[str, Any], tracker: StreamTracker, now: float) -> None:
    """A text chunk counts one token unless it carries ``usage``; a final usage-only chunk fixes the count."""
    _raise_on_error(chunk)
    usage = chunk.get("usage") or {}
    choices = chunk.get("choices") or []
    result = tracker.result
    if usage.get("prompt_tokens"):
        result.input_len = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = int(details["cached_tokens"])
    reported = usage.get("completion_tokens")
    if choices and choices[0].get("text"):
        tracker.observe(max(int(reported or 0), result.output_tokens + 1), now)
    elif reported is not None and tracker.last_token_time is None:
        tracker.observe(int(reported), now)
    elif reported is not None:
        _correct_final_count(tracker, int(reported))


def _correct_final_count(tracker: StreamTracker, count: int) -> None:
    delta = count - tracker.result.output_tokens
    if delta and tracker.result.chunk_tokens:
        tracker.result.chunk_tokens[-1] = max(0, tracker.result.chunk_tokens[-1] + delta)
    tracker.result.output_tokens = count


async def _consume(resp: aiohttp.ClientResponse, cfg: BackendConfig, tracker: StreamTracker) -> None:
    handle = handle_openai_chunk if cfg.backend == "openai" else handle_sglang_chunk
    if "text/event-stream" not in resp.headers.get("Content-Type", "event-stream"):
        handle(await resp.json(content_type=None), tracker, time.perf_counter())  # server ignored stream
        return
    async for data in iter_sse_data(resp):
        if data == "[DONE]":
            break
        handle(json.loads(data), tracker, time.perf_counter())


async def send_request(
    session: aiohttp.ClientSession,
    cfg: BackendConfig,
    spec: RequestSpec,
    result: RequestResult,
    bench_t0: float,
) -> None:
    """Send one streaming request and fill ``result`` in place (partial data survives cancellation)."""
    url, payload = build_request(cfg, spec)
    start = time.perf_counter()
    result.send_s = start - bench_t0
    tracker = StreamTracker(result, start, bench_t0)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    try:
        async with session.post(url, json=payload, headers=headers(cfg), timeout=timeout) as resp:
            if resp.status // 100 != 2:
                body = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {body}"
                return
            await _consume(resp, cfg, tracker)
        if result.output_tokens <= 0:
            result.error = "stream ended without output tokens"
            return
        result.success = True
    except asyncio.TimeoutError:
        result.error = f"timeout after {cfg.request_timeout_s:g} s"
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    except (StreamError, ValueError, TypeError, AttributeError) as exc:
        result.error = f"bad response: {type(exc).__name__}: {exc}"[:300]
    finally:
        end = time.perf_counter()
        result.end_s = end - bench_t0
        result.e2e_s = end - start
