"""Shared fixtures. `SGLANG_EXT_TEST_DEVICE=cuda` runs the engine tests on a GPU (torch backend)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

TEST_DEVICE = os.environ.get("SGLANG_EXT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def test_device() -> str:
    return TEST_DEVICE


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZeroMQ context for fake workers in router tests."""
    c = zmq.asyncio.Context()
    yield c
    c.term()
