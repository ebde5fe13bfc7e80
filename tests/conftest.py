"""Shared fixtures. `SGLANG_EXT_TEST_DEVICE=cuda` runs the engine tests on a GPU (torch backend)."""

from __future__ import annotations

import os

import pytest

TEST_DEVICE = os.environ.get("SGLANG_EXT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def test_device() -> str:
    return TEST_DEVICE
