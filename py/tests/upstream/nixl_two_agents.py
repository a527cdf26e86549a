"""Two real NIXL agents in the .venv-vllm environment, driven with the same
nixl 1.5.1 Python calls vLLM 0.34.0's pull worker makes: proof that the
substrate for kvlease's end-to-end plugin tests works on this GPU-less machine.

Owns: one READ of two int64 blocks from P's registered torch tensor into D's
registered numpy array (strided Nx5 descriptor lists, the form vLLM prepares),
with the read-done notification attached to the READ, then a standalone
``HB:`` notification; under each UCX transport given. May not touch vLLM.

    python nixl_two_agents.py            # UCX default, tcp, shm (each in its own process)
    python nixl_two_agents.py --one TLS  # one run in this process ("" = UCX default)

Exit status 0 only if every run moved the right words and delivered both
notifications. Timing is printed for information, never asserted.

Why nixl_cu12._api and not nixl._api, by default: torch 2.14.0 from PyPI is a CUDA 13
build, and the ``nixl`` meta package picks ``nixl_cu<major of torch's CUDA>``,
so ``import nixl`` asks for nixl-cu13 while the environment has nixl-cu12
(as issue 20 specifies). vLLM's own import (vllm.distributed.nixl_utils) fails
the same way and leaves NixlWrapper None; tests that drive vLLM's worker with
real agents must patch ``base_worker.NixlWrapper`` / ``nixl_agent_config`` to
these classes, as upstream's tests patch in their FakeNixlWrapper.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

WORDS_PER_BLOCK = 4
BLOCK_BYTES = WORDS_PER_BLOCK * 8
TIMEOUT_S = 10.0


def strided(base: int, blocks: int) -> np.ndarray:
    """One Nx5 row per block: (address, length, device id, stride, count)."""
    rows = np.zeros((blocks, 5), dtype=np.uint64)
    for i in range(blocks):
        rows[i] = (base + i * BLOCK_BYTES, BLOCK_BYTES, 0, BLOCK_BYTES, 1)
    return rows


def make_agent(api, name: str, tls: str):
    # shm alone needs UCX error handling "none" (the default "peer" mode fails
    # to create the backend); vLLM passes that through
    # kv_connector_extra_config["ucx_backend_params"], i.e. create_backend.
    if tls == "shm":
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        return agent
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def one_run(tls: str) -> None:
    import torch

    # nixl_cu12 and nixl_cu13 cannot share a process (pybind11 registers the
    # same types twice), so use the meta package when it resolves (nixl-cu13
    # installed, KVLEASE_VLLM_NIXL_CU13=1) and nixl_cu12 directly otherwise.
    try:
        from nixl import _api as api

        meta_note = f"via nixl._api = {api.__name__}"
    except ImportError as e:
        from nixl_cu12 import _api as api

        meta_note = f"via nixl_cu12._api; nixl._api does not import ({e})"

    t0 = time.perf_counter()
    p = make_agent(api, "P", tls)
    d = make_agent(api, "D", tls)
    t_agents = time.perf_counter() - t0

    # P: 8 blocks of a torch int64 tensor (vLLM registers torch KV caches).
    src = torch.arange(8 * WORDS_PER_BLOCK, dtype=torch.int64) * 7 + 3
    dst = np.zeros(2 * WORDS_PER_BLOCK, dtype=np.int64)
    # vLLM: get_reg_descs([(start, len, device_id, "")], mem_type) + register_memory.
    p.register_memory(p.get_reg_descs([(src.data_ptr(), src.numel() * 8, 0, "")], "DRAM"))
    d.register_memory(d.get_reg_descs([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM"))

    # Handshake: metadata both ways (vLLM: the ZMQ side channel carries it).
    t1 = time.perf_counter()
    p_name = d.add_remote_agent(p.get_agent_metadata())
    d_name = p.add_remote_agent(d.get_agent_metadata())
    assert p_name in ("P", b"P") and d_name in ("D", b"D"), (p_name, d_name)
    p_name = p_name.decode() if isinstance(p_name, bytes) else p_name
    t_md = time.perf_counter() - t1

    local = d.prep_xfer_dlist("NIXL_INIT_AGENT", strided(dst.ctypes.data, 2), mem_type="DRAM")
    remote = d.prep_xfer_dlist(p_name, strided(src.data_ptr(), 8), mem_type="DRAM")

    # READ P's blocks 5 and 2 into D's blocks 0 and 1, read-done attached.
    notif_id = b"req-1:1"  # "{remote_request_id}:{expected_consumers}"
    t2 = time.perf_counter()
    handle = d.make_prepped_xfer("READ", local, [0, 1], remote, [5, 2], notif_msg=notif_id)
    state = d.transfer(handle)
    got: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if state == "PROC":
            state = d.check_xfer_state(handle)
        if state == "ERR":
            raise SystemExit(f"[{tls or 'default'}] READ ended in ERR")
        for agent, msgs in p.get_new_notifs().items():
            got.setdefault(agent, []).extend(msgs)
        if state == "DONE" and got:
            break
    t_read = time.perf_counter() - t2
    d.release_xfer_handle(handle)
    expect = torch.cat([src[5 * 4 : 6 * 4], src[2 * 4 : 3 * 4]]).tolist()
    if state != "DONE" or dst.tolist() != expect:
        raise SystemExit(f"[{tls or 'default'}] READ state {state}, got {dst.tolist()}, want {expect}")
    if got != {"D": [notif_id]}:
        raise SystemExit(f"[{tls or 'default'}] read-done notification: got {got}")

    # Standalone heartbeat D -> P (vLLM: _send_heartbeats, "HB:" + ids joined by ",").
    t3 = time.perf_counter()
    d.send_notif(p_name, notif_msg=b"HB:req-1,req-2")
    hb: list[bytes] = []
    while time.monotonic() < deadline + TIMEOUT_S and not hb:
        hb = p.get_new_notifs().get("D", [])
    t_hb = time.perf_counter() - t3
    if hb != [b"HB:req-1,req-2"]:
        raise SystemExit(f"[{tls or 'default'}] heartbeat: got {hb}")

    d.release_dlist_handle(local)
    d.release_dlist_handle(remote)
    print(
        f"[UCX_TLS={tls or '(unset)'}] ok: READ 2 blocks {dst.tolist()}, "
        f"notifs {got['D']} + {hb}; agents {t_agents * 1e3:.1f} ms, metadata "
        f"{t_md * 1e3:.2f} ms, READ+notif {t_read * 1e6:.0f} us, HB {t_hb * 1e6:.0f} us; "
        f"{meta_note}"
    )


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--one":
        one_run(argv[1])
        return 0
    failed = 0
    for tls in ("", "tcp", "shm"):
        env = dict(os.environ)
        env.pop("UCX_TLS", None)
        if tls:
            env["UCX_TLS"] = tls
        r = subprocess.run([sys.executable, __file__, "--one", tls], env=env,
                           capture_output=True, text=True, timeout=120)
        out = [line for line in r.stdout.splitlines() if line.startswith("[UCX_TLS")]
        print("\n".join(out) if out else f"[UCX_TLS={tls or '(unset)'}] no result line")
        if r.returncode != 0:
            failed += 1
            print(r.stdout[-2000:], r.stderr[-2000:], sep="\n")
    print(f"{3 - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
