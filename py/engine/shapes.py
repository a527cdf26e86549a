"""The shapes of the real-engine cases' instances: the pull pairs' lease,
P's small KV cache and chunked prefill, D's small cache, and each phase's
set of roles (``PHASE_A``, ``PHASE_F``).

Owns: what each role runs as (``InstanceSpec``). May not start anything:
``fleet.Fleet.ensure`` does, when a case asks for a phase.
"""

from __future__ import annotations

from instances import InstanceSpec
from push_pairs import PUSH_EXTRA

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
D_SMALL_SPEC = d_spec("kvlease", **D_SMALL)
PHASE_A = dict(p=p_spec("kvlease"), d=d_spec("kvlease"),
               p_stock=p_spec("stock"), d_stock=d_spec("stock"))
ASYNC_ENV = {"KVLEASE_ENGINE_ASYNC_SCHEDULING": "1"}


def push_spec(role: str, connector: str, **kw) -> InstanceSpec:
    """A push P (``role`` "p") or D: the push pairs' lease, P's small cache."""
    if role == "p":
        return InstanceSpec(name=f"p-{connector}", connector=connector, extra=dict(PUSH_EXTRA),
                            num_blocks=P_BLOCKS, prefill=True, **kw)
    return InstanceSpec(name=f"d-{connector}", connector=connector, extra=dict(PUSH_EXTRA), **kw)


PHASE_F = dict(p_push=push_spec("p", "kvlease-push"), d_push=push_spec("d", "kvlease-push"),
               p_push_stock=push_spec("p", "stock-push"),
               d_push_stock=push_spec("d", "stock-push"))
