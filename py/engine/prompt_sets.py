"""The prompt sets of the real-engine cases, all known up front so that one
plain ``vllm serve`` answers them once (the ``sets`` fixture, conftest.py):
each set's token ids, ``max_tokens`` and, once answered, the reference
texts every case compares with.

Owns: the sets and their seeds. May not run them.
"""

from __future__ import annotations

import workload
from workload import make_prompts

HAPPY = ("happy", 24, 1, {})
LATE_A = ("late-a", 1, 2, {})
FILLER = ("filler", 14, 3, {})
#: 32 x 300 tokens, one request at a time on the small D: 24 of them took
#: 37 s once D no longer starved (13 past lease + interval), which would
#: leave a host twice as fast about 3; 32 leave it about 8. (400 tokens
#: leave the small D 2 blocks beside the running request, and 32 of them
#: took 152 s.)
OVERLOAD = ("overload", 32, 4, {"min_len": 40, "max_len": 60, "max_tokens": 300})
PREEMPT = ("preempt", 6, 5, {"min_len": 380, "max_len": 420, "max_tokens": 8})
SOAK = ("soak", 200, 6, {"min_len": 64, "max_len": 128, "max_tokens": 12})
#: Decodes long enough (up to 510 tokens, 16 of the small D's 17 blocks) that
#: the small D reads the queue's KV one request at a time: P still holds
#: most of it when D is killed (with 200-token decodes D had read all 8
#: within 10 s, and a kill 7 s in found P nearly empty).
KILL = ("kill", 8, 7, {"min_len": 96, "max_len": 110, "max_tokens": 400})
AFTER = ("after", 8, 8, {})
MIXED = ("mixed", 12, 9, {})
TP2 = ("tp2", 12, 10, {})
ASYNC = ("async", 12, 11, {})
#: Push mode (phase F): each set runs on the kvlease pair and the stock pair.
PUSH_HAPPY = ("push-happy", 8, 12, {})
PUSH_LATE = ("push-late", 4, 13, {})
PUSH_MIXED = ("push-mixed", 4, 14, {})
PUSH_KILL = ("push-kill", 4, 15, {})
SETS = [HAPPY, LATE_A, FILLER, OVERLOAD, PREEMPT, SOAK, KILL, AFTER, MIXED, TP2, ASYNC,
        PUSH_HAPPY, PUSH_LATE, PUSH_MIXED, PUSH_KILL]


class PromptSet:
    def __init__(self, model: str, spec) -> None:
        name, n, seed, opts = spec
        opts = dict(opts)
        self.name = name
        self.max_tokens = opts.pop("max_tokens", workload.MAX_TOKENS)
        self.prompts = make_prompts(model, n, seed, **opts)
        self.reference: list[str] = []
