"""The plugin's clock: the one place it reads the time.

Owns: the reading every ``now`` the plugin hands to kvlease's core comes
from (the core never reads a clock itself). May not keep state.

Why ``time.monotonic`` and not ``time.perf_counter``: vLLM's own tests patch
``perf_counter`` for their deadlines, and a lease must not move with them.
On Linux both read ``CLOCK_MONOTONIC``, the clock vLLM's scheduler stamps
``scheduler_clock`` with and its side channel answers with (push mode
checks that at start: ``push_worker.py``).

Each module binds it as ``_now`` (``from .clock import now as _now``), so
that a test patches one module's clock and no other.
"""

from __future__ import annotations

import time


def now() -> float:
    """Seconds on this process's monotonic clock."""
    return time.monotonic()
