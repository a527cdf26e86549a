"""kvlease in a real vLLM engine, fleet shapes (issue 37), after
``test_real_engine.py``'s phases A to F.

Every P and D of those phases already runs on two hosts whose monotonic
clocks differ by 10^5 s (``shapes.py``): phases A, C and D (pull) with D's
clock ahead, phases E (pull) and F (push) with P's. What is left for the
push guard, the one part of kvlease that reads the other side's clock, is
push with D's clock ahead: phase G.

=====  ==========================================  ===========================================
phase  instances (role: connector, host)           cases
=====  ==========================================  ===========================================
G      D's host 10^5 s ahead (``D_AHEAD``, the      push happy path and P's estimate of D's
       hosts of phase A): gp_push, gd_push:         clock against the true offset; a push
       kvlease push                                 registration that reaches P late
=====  ==========================================  ===========================================

No stock control here: stock vLLM reads no clock across hosts, and phase
F's stock push pair, on two hosts with the clocks the other way round,
shows its hang on a late registration already.
"""

from __future__ import annotations

from push_pairs import (PUSH_LEASE, clock_estimate, d_leak, estimate_within_its_bound,
                        every_push_served, push_round)
from shapes import D_AHEAD, on, push_spec

PHASE_G = dict(gp_push=on(push_spec("p", "kvlease-push"), D_AHEAD.p),
               gd_push=on(push_spec("d", "kvlease-push"), D_AHEAD.d))
ROLES = ("gp_push", "gd_push")


def test_two_hosts_d_ahead_push_happy_path_and_ps_estimate_of_ds_clock(fleet, sets, record):
    """Push across hosts, D's clock 10^5 s ahead: every push guarded and
    written (or, when P could not serve in time, recomputed), none hangs,
    D's blocks come back, and P's estimate of D's clock is within the bound
    it claims of the true offset (+10^5 s)."""
    fleet.only(**PHASE_G)
    f = push_round(fleet, "kvlease", sets["push-happy"], "g-push-happy", roles=ROLES)
    f.update(d_leak(fleet.running["gd_push"], settle_s=0))
    f.update(clock_estimate(fleet.running["gp_push"], D_AHEAD.true_offset))
    f["crashes"] = len(fleet.check_crashes())
    record.write("two hosts, D +1e5 s: push happy + clock estimate", "kvlease", **f)
    every_push_served(f)
    assert f["wrong_answers"] == 0, f
    assert f["written"] >= 1 and f["permits"] >= f["requests"], f
    estimate_within_its_bound(f)
    assert f["crashes"] == 0, f


def test_two_hosts_d_ahead_push_late_registration(fleet, sets, record):
    """A push registration that reaches P after P let the request go, D's
    clock 10^5 s ahead: P refuses it at once (its gate reads D's deadline
    through the estimate), D fails the load and recomputes, and D's blocks
    come back."""
    fleet.only(**PHASE_G)
    ps = sets["push-late"]
    f = push_round(fleet, "kvlease", ps, "g-push-late", concurrency=len(ps.prompts),
                   between_s=PUSH_LEASE + 10, roles=ROLES)
    f.update(d_leak(fleet.running["gd_push"]))
    f["crashes"] = len(fleet.check_crashes())
    record.write("two hosts, D +1e5 s: push late registration", "kvlease", **f)
    every_push_served(f)
    assert f["push_failed"] >= 1 and f["d_usage_end"] == 0, f
    assert f["crashes"] == 0, f


def test_no_instance_crashed_in_the_whole_run(fleet, record):
    """Last: no instance exited without a case asking it to (phases A to G)."""
    fleet.only()
    fleet.check_crashes()
    record.write("crashes (whole run, phase G included)", "all", crashes=len(fleet.crashes))
    assert not fleet.crashes, fleet.crashes
