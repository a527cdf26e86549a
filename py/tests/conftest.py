"""Shared fixtures of the binding tests: a small engine's config, and a
clock that only moves when a test says so (the roles never read one)."""

from __future__ import annotations

import pytest

import kvlease


@pytest.fixture
def config() -> kvlease.LeaseConfig:
    return kvlease.LeaseConfig.parse({"kv_lease_duration": 30}, 64, 8)


class Clock:
    """Seconds, moved by hand."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()
