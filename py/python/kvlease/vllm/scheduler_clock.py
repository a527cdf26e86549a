"""A D worker's reading of its scheduler's clock: the clock that push mode's
permits are stamped on.

Owns: one lower bound of ``scheduler clock - worker clock``, fed by the
``scheduler_clock`` reading vLLM puts in every step's connector metadata
(the scheduler process's ``perf_counter`` when it built the step), and the
scheduler clock it gives for a worker reading (:class:`SchedulerClock`).
May not read a clock itself: callers pass both readings.

Why: P's estimate of D's clock comes from vLLM's side channel, whose
listener runs in D's *scheduler* process and stamps its replies with that
process's ``perf_counter``. A D worker may run on another host than its
scheduler (multi-node TP), where ``CLOCK_MONOTONIC`` counts from another
boot. A deadline the worker stamped on its own clock would then be off by
the hosts' boot-time difference in P's eyes: every push refused, or a WRITE
let through after D's fence. So D's permits live on the scheduler's clock,
as vLLM's own push worker rebases the scheduler's deadlines
(``scheduler_clock``).

Why a lower bound is safe: the scheduler read its clock *before* the worker
received the step, so each sample ``scheduler_clock - worker_now``
undershoots the true offset by the step's transit time, never overshoots.
Clocks on two hosts drift apart by at most ``drift_ppm``, so an old sample
is moved down by that much per second of age, and the best (largest) bound
is kept. A scheduler time read through a lower bound is never later than
the true one, and with it:

- a permit's deadline is no later than it would be on the scheduler's own
  clock: P's gate closes no later than it should;
- D's fence (deadline + write bound) is reached no earlier than on the
  scheduler's own clock: D frees no earlier than the guard allows.

The cost of the undershoot (the transit time, milliseconds unless the
worker stalled) is a window that many milliseconds shorter, and a fence as
much later.
"""

from __future__ import annotations

import threading


class SchedulerClock:
    """The lower bound of the module docs, shared by the worker's main
    thread (which observes each step) and vLLM's writer thread (which
    stamps permits)."""

    def __init__(self, drift_ppm: int) -> None:
        self._drift = max(0, int(drift_ppm)) * 1e-6
        self._lock = threading.Lock()
        #: The bound, as of worker time ``_at``.
        self._offset: float | None = None
        self._at = 0.0

    def observe(self, scheduler_reading: float, worker_now: float) -> None:
        """A step's ``scheduler_clock``, received at ``worker_now``. A
        reading of 0 (vLLM's default: none stamped) is ignored."""
        if not scheduler_reading:
            return
        sample = scheduler_reading - worker_now
        with self._lock:
            if self._offset is not None:
                kept = self._offset - self._drift * max(0.0, worker_now - self._at)
                if kept > sample:
                    sample = kept
            self._offset, self._at = sample, worker_now

    def now(self, worker_now: float) -> float | None:
        """The scheduler's clock at ``worker_now``, never later than the
        truth; None before the first step's reading."""
        with self._lock:
            if self._offset is None:
                return None
            return worker_now + self._offset - self._drift * max(0.0, worker_now - self._at)
