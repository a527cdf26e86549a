"""The KV bytes a request's blocks hold in the end-to-end tests.

Owns: the value every byte of block ``i`` of a prompt holds, on P after its
prefill and on D after a load or a local recompute, and the fill/read of a
worker's KV tensors. May not know about leases.

Why one byte value per (prompt, block): it survives any head split between
tensor-parallel ranks and any KV layout, so D's block can be compared with
P's whatever the TP sizes, and a block that holds another prompt's KV shows
a different value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def block_value(prompt: Sequence[int], index: int) -> int:
    """1..255: the byte every byte of block ``index`` of ``prompt`` holds."""
    h = hashlib.sha256(repr((tuple(prompt), index)).encode()).digest()
    return h[0] % 255 + 1


def fill_block(layers: Sequence[torch.Tensor], block: int, value: int) -> None:
    """Writes ``value`` into every byte of ``block`` of every layer view
    (vLLM's KV views put the block first)."""
    for t in layers:
        t.view(torch.uint8)[block].fill_(value)


def block_bytes(layers: Sequence[torch.Tensor], block: int) -> set[int]:
    """The distinct byte values ``block`` holds across every layer."""
    out: set[int] = set()
    for t in layers:
        out.update(torch.unique(t.view(torch.uint8)[block]).tolist())
    return out
