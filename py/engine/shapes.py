"""The shapes of the real-engine cases' instances: the two hosts they run
on, the pull pairs' lease, P's small KV cache and chunked prefill, D's
small cache, and each phase's set of roles (``PHASE_A``, ``PHASE_F``).

Owns: what each role runs as (``InstanceSpec``) and on which host. May not
start anything: ``fleet.Fleet.ensure`` does, when a case asks for a phase;
nor make the hosts: the session fixture ``two_hosts`` (conftest.py) does.

The hosts (issue 37): every P and D runs on one of two "hosts", network
namespaces on a bridge this machine's own namespace reaches (the routers
and the plain reference run there), with UCX over TCP between them and
vLLM's side channels on the hosts' addresses; one of the two also sits in
a time namespace whose ``CLOCK_MONOTONIC`` runs ``OFFSET`` seconds ahead
(``py/tests/vllm/harness/hosts.py``). Phases A, C and D (pull) and G
(push) run with D's clock ahead (``D_AHEAD``), phases E (pull) and F
(push) with P's (``P_AHEAD``): both kinds, both ways round, with no
instance started for the hosts alone.
"""

from __future__ import annotations

import dataclasses

from instances import InstanceSpec  # first: it puts the harness on the path
from harness import hosts  # noqa: E402
from push_pairs import PUSH_EXTRA

#: How far the host in the time namespace runs ahead (s): D's clock minus
#: P's is exactly this on D_AHEAD, minus this on P_AHEAD.
OFFSET = 100_000
#: Names and addresses only: made and removed by the ``two_hosts`` fixture.
#: Subnets 10.79 and 10.80: not the harness's 10.78, so a step 10 left
#: running beside cannot collide.
D_AHEAD = hosts.TwoHosts(ahead="D", offset=OFFSET, subnet=79)
P_AHEAD = hosts.TwoHosts(ahead="P", offset=OFFSET, subnet=80)


def on(spec: InstanceSpec, host) -> InstanceSpec:
    """``spec`` started on ``host`` (its log named after the host)."""
    return dataclasses.replace(spec, name=f"{spec.name}-on-{host.name}", host=host)

#: kv_lease_duration (s): heartbeat every 3 s, extension 12 s. At least 12 s
#: on 2 cores (P's HTTP replies alone took up to 6 s under load); 18 s leaves
#: the extension room for a D step seconds late on a loaded machine.
LEASE = 18.0
INTERVAL = LEASE // 6
EXTENSION = LEASE * 2 // 3
EXTRA = {"kv_lease_duration": int(LEASE)}
#: P's KV cache in blocks of 32 tokens: small, so freed blocks are reused at
#: once (the late-arrival and soak controls need that), and smaller than four
#: long prompts (the preemption case: 4 running x 13 blocks > 40).
P_BLOCKS = 40
#: P prefills up to four requests at once in chunks of 32 tokens, so
#: concurrent long prompts run out of blocks mid-prefill and vLLM preempts
#: them (the preemption case).
P_ARGS = ["--max-num-batched-tokens", "128", "--long-prefill-token-threshold", "32"]
#: D's KV cache in the overload and D-killed cases: room for one or two
#: requests, so the others wait in D's queue, heartbeated, their blocks held
#: on P (a D with room for all reads them at once, and P holds nothing).
#: vLLM needs one max-length sequence (512 tokens) plus its null block.
D_SMALL_BLOCKS = 18
#: ... and it runs one request at a time, so that the queue outlives the
#: lease however fast the machine decodes (a D that is not starved decodes
#: 24 overload requests (300 tokens each) four at a time in under 20 s).
D_SMALL = dict(num_blocks=D_SMALL_BLOCKS, args=["--max-num-seqs", "1"])


def p_spec(connector: str, tp: int = 1, **kw) -> InstanceSpec:
    name = f"p-{connector}" + (f"-tp{tp}" if tp > 1 else "") + ("-async" if "env" in kw else "")
    return InstanceSpec(name=name, connector=connector, extra=dict(EXTRA), tp=tp,
                        num_blocks=P_BLOCKS, args=list(P_ARGS), prefill=True, **kw)


def d_spec(connector: str, **kw) -> InstanceSpec:
    name = (f"d-{connector}" + (f"-{kw['num_blocks']}blocks" if "num_blocks" in kw else "")
            + ("-async" if "env" in kw else ""))
    return InstanceSpec(name=name, connector=connector, extra=dict(EXTRA), **kw)


REF = InstanceSpec(name="ref")
#: Phase D's D, started with phase C's new P (one start fewer: about 35 s).
D_SMALL_SPEC = on(d_spec("kvlease", **D_SMALL), D_AHEAD.d)
#: Phase C's new P and phase D's: data parallel 2 (two EngineCores, each
#: with its own scheduler, connector and lease book, on side-channel ports
#: base + DP index, behind one API server port), so that phases C and D
#: run against DP ranks with no start of their own.
P_DP2 = on(dataclasses.replace(p_spec("kvlease"), name="p-kvlease-dp2", dp=2), D_AHEAD.p)
PHASE_A = dict(p=on(p_spec("kvlease"), D_AHEAD.p), d=on(d_spec("kvlease"), D_AHEAD.d),
               p_stock=on(p_spec("stock"), D_AHEAD.p), d_stock=on(d_spec("stock"), D_AHEAD.d))
ASYNC_ENV = {"KVLEASE_ENGINE_ASYNC_SCHEDULING": "1"}


def push_spec(role: str, connector: str, **kw) -> InstanceSpec:
    """A push P (``role`` "p") or D: the push pairs' lease, P's small cache."""
    if role == "p":
        return InstanceSpec(name=f"p-{connector}", connector=connector, extra=dict(PUSH_EXTRA),
                            num_blocks=P_BLOCKS, prefill=True, **kw)
    return InstanceSpec(name=f"d-{connector}", connector=connector, extra=dict(PUSH_EXTRA), **kw)


PHASE_F = dict(p_push=on(push_spec("p", "kvlease-push"), P_AHEAD.p),
               d_push=on(push_spec("d", "kvlease-push"), P_AHEAD.d),
               p_push_stock=on(push_spec("p", "stock-push"), P_AHEAD.p),
               d_push_stock=on(push_spec("d", "stock-push"), P_AHEAD.d))
