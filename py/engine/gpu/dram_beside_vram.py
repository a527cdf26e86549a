#!/usr/bin/env python3
"""On one NVIDIA GPU: can a NIXL agent that registers vLLM's VRAM KV cache
*and* kvlease's DRAM lease regions READ both, under each UCX transport
setting? (issue 28 item 4, the review's remaining risk.)

On a GPU, vLLM registers only VRAM (its KV cache). kvlease adds DRAM: P's
lease-slot array (``kvlease.vllm.rank_leases.RankLeases.register``) and D's
slot-READ landing buffers (``kvlease.vllm.load_checks.LoadChecks.register_landing``).
With ``UCX_TLS=cuda_ipc,cuda_copy`` and the like, registration may succeed
and a DRAM READ still fail: then every lease check on D fails. This script
measures that, with nothing of kvlease imported (plain nixl calls that mirror
kvlease's and vLLM's, cited below), so it needs only torch (CUDA) and the
``nixl`` / ``nixl-cu13`` wheels.

Per UCX_TLS setting, in two fresh processes (UCX reads UCX_TLS at init), as
vLLM's P and D workers on the same GPU:

* P: KV blocks in VRAM (a torch.cuda uint8 tensor, a per-block byte
  pattern), registered as "VRAM"; a lease-slot array in DRAM (plain heap
  memory, int64 words as kvlease's Rust slot array is; slot ``SLOT`` holds
  ``NONCE``, every other slot a filler), registered as "DRAM". Exports its
  agent metadata.
* D: VRAM destination blocks and a DRAM landing buffer, registered the same
  way; loads P's metadata; READs three VRAM blocks (VRAM->VRAM, with the
  read-done notification attached, as vLLM's pull worker does) and the slot
  word (DRAM->DRAM, as kvlease's slot check does), both posted at once and
  polled with ``check_xfer_state`` for at most ``--timeout`` seconds; checks
  every byte and the nonce.
* Notifications both ways: D->P a standalone ``HB:`` (vLLM's heartbeat),
  P->D a standalone message; plus the read-done attached to the VRAM READ.

    python dram_beside_vram.py [--json out.json] [--tls SETTING ...] [--timeout S]
    python dram_beside_vram.py --cpu-dry-run     # same flow, "VRAM" -> DRAM (no GPU)

A setting "" (or "default") leaves UCX_TLS unset; a suffix "+err=none"
creates the UCX backend with ``ucx_error_handling_mode=none`` (vLLM 0.34's
``ucx_backend_params``). Settings naming an
InfiniBand transport (rc, dc, ud, ...) are skipped with the reason when the
machine has no RDMA device. Prints one table and writes the JSON given by
``--json``. Exit 0 when the survey ran, whatever the transports did; 2 when
the script itself failed (nixl or CUDA-enabled torch missing, a Python error
outside the NIXL calls).
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import traceback

MARK = "@@dram_beside_vram "
#: Setting suffix: create UCX with ucx_error_handling_mode "none", as vLLM
#: 0.34 does when kv_connector_extra_config has that ucx_backend_params.
ERR_NONE = "+err=none"
GPU_SETTINGS = [
    "",
    "cuda_ipc,cuda_copy",
    "cuda_ipc,cuda_copy,tcp",
    "cuda_copy,tcp",
    "rc,cuda_copy",
    "sm,cuda_copy,cuda_ipc",
    # vLLM 0.34's ucx_backend_params (kv_connector_extra_config), which
    # UCX_TLS=shm-style settings need: {"ucx_error_handling_mode": "none"}.
    "cuda_ipc,cuda_copy" + ERR_NONE,
    "sm,cuda_copy,cuda_ipc" + ERR_NONE,
    # vLLM 0.34's sleep mode creates UCX with engine_config TLS=^cuda_ipc.
    "^cuda_ipc",
]
DRY_SETTINGS = ["", "tcp"]
IB_TRANSPORTS = {"rc", "rc_v", "rc_x", "rc_mlx5", "rc_verbs", "dc", "dc_x", "dc_mlx5",
                 "ud", "ud_v", "ud_x", "ud_mlx5", "ud_verbs", "ib"}

N_BLOCKS = 16
BLOCK_BYTES = 64 * 1024
#: D reads P's blocks READ_FROM into its blocks READ_INTO.
READ_FROM = [5, 2, 11]
READ_INTO = [0, 1, 2]
N_SLOTS = 64
SLOT = 13
#: Below 2^53, as kvlease's nonces are (issue 28 finding 2).
NONCE = 0x1F2E3D4C5B6A79
LANDING_WORDS = 8
LANDING_AT = 3
LANDING_FILL = 0xDEADBEEFDEADBEEF
READ_DONE = b"req-1:1"  # vLLM's plain read-done, "{remote_request_id}:{consumers}"
HEARTBEAT = b"HB:req-1"  # vLLM's heartbeat, "HB:" + ids
P_TO_D = b"P2D:hello"


def label(setting: str) -> str:
    if setting.endswith(ERR_NONE):
        return (setting[: -len(ERR_NONE)] or "(unset)") + ERR_NONE
    return setting or "(unset)"


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:500]


# --------------------------------------------------------------------------
# child: one NIXL agent, role P or D


def emit(kind: str, **fields) -> None:
    sys.stdout.write(MARK + json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


def import_nixl():
    """nixl._api (the meta package picks nixl_cu<torch's CUDA major>, as in
    vLLM's nixl_utils), else nixl_cu13._api, else nixl_cu12._api. nixl_cu12
    and nixl_cu13 cannot share a process (py/VLLM_MAP.md §8 hazard 1): the
    first that imports wins."""
    notes = []
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            api = __import__(mod, fromlist=["nixl_agent"])
            return api, f"{api.__name__}" + (f" ({'; '.join(notes)})" if notes else "")
        except ImportError as e:
            notes.append(f"{mod}: {e}")
    raise ImportError("no NIXL Python package: " + "; ".join(notes))


def ucx_version(api) -> str | None:
    """UCX's own version string, from the libucp the nixl wheel bundles."""
    try:
        import ctypes
        import glob

        pkg = api.__name__.split(".")[0]
        if pkg == "nixl":
            pkg = api.nixlBind.__name__.split(".")[0]
        base = os.path.dirname(os.path.dirname(os.path.abspath(api.__file__)))
        libs = sorted(glob.glob(os.path.join(base, f"{pkg}.libs", "libucp*.so*")))
        if not libs:
            return None
        f = ctypes.CDLL(libs[0]).ucp_get_version_string
        f.restype = ctypes.c_char_p
        return f().decode()
    except Exception as e:  # informational only
        return f"unknown ({err(e)})"


def stage(record: dict, name: str, fn):
    """Runs one NIXL step; records "ok" or the error. Returns (ok, value)."""
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as e:
        record[name] = {"ok": False, "error": err(e)}
        return False, None
    record[name] = {"ok": True, "ms": round((time.perf_counter() - t0) * 1e3, 3)}
    return True, value


def kv_pattern(torch, device, n_blocks: int):
    """Byte j of block i: (37 i + 11 j + 0x5A) mod 251 (never a fill byte
    pattern, and different in every block)."""
    idx = torch.arange(n_blocks * BLOCK_BYTES, device=device, dtype=torch.int64)
    return ((idx // BLOCK_BYTES) * 37 + (idx % BLOCK_BYTES) * 11 + 0x5A).remainder(251).to(
        torch.uint8
    )


def child(role: str, args) -> int:
    import numpy as np

    t_start = time.monotonic()
    out: dict = {"role": role, "stages": {}}
    st = out["stages"]
    try:
        import torch
    except ImportError as e:
        emit("fatal", error=f"torch: {err(e)}")
        return 2
    try:
        api, how = import_nixl()
    except ImportError as e:
        emit("fatal", error=err(e))
        return 2
    out["nixl_module"] = how
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    if args.cpu_dry_run:
        device, kv_mem, dev_id = torch.device("cpu"), "DRAM", 0
    else:
        if not torch.cuda.is_available():
            emit("fatal", error="torch.cuda.is_available() is False (use --cpu-dry-run without a GPU)")
            return 2
        torch.cuda.set_device(args.device)
        device, kv_mem, dev_id = torch.device("cuda", args.device), "VRAM", args.device
        out["gpu"] = torch.cuda.get_device_name(args.device)
    out["kv_mem"] = kv_mem

    # The agent as vLLM 0.32-0.34 builds it with backends ["UCX"]
    # (NixlConnectorWorker.__init__ in nixl/base_worker.py:
    # nixl_agent_config(num_threads=4, capture_telemetry=True), progress
    # thread on by default).
    # With ucx_backend_params, vLLM 0.34 builds the agent with backends=[]
    # and then create_backend("UCX", {"num_threads": "4", **params}).
    backends = ["UCX"]

    def make_agent():
        if not args.ucx_err_none:
            return api.nixl_agent(role, api.nixl_agent_config(num_threads=4, capture_telemetry=True))
        a = api.nixl_agent(role, api.nixl_agent_config(backends=[], capture_telemetry=True))
        a.create_backend("UCX", {"num_threads": "4", "ucx_error_handling_mode": "none"})
        return a

    ok, agent = stage(st, "agent", make_agent)
    if ok and "UCX" not in agent.backends:
        ok = False
        st["agent"] = {"ok": False, "error": "UCX backend was not created "
                       f"(plugins {agent.get_plugin_list()})"}
    out["ucx_version"] = ucx_version(api)
    if ok:
        out["ucx_mem_types"] = [str(m) for m in agent.get_backend_mem_types("UCX")]

    # KV blocks: P's hold the pattern, D's a fill byte. uint8, contiguous.
    if role == "P":
        kv = kv_pattern(torch, device, N_BLOCKS)
    else:
        kv = torch.full((len(READ_INTO) * BLOCK_BYTES,), 0xEE, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    # DRAM lease words: plain heap memory (kvlease's slot array and landing
    # buffers are Rust-owned heap memory, not pinned), int64 words.
    if role == "P":
        words = np.array([0xA5A50000 + i for i in range(N_SLOTS)], dtype=np.uint64)
        words[SLOT] = NONCE
    else:
        words = np.full(LANDING_WORDS, LANDING_FILL, dtype=np.uint64)

    ok_md, md = False, None
    if ok:
        # vLLM's registration of its KV caches (base_worker.register_kv_caches):
        # get_reg_descs([(start, len, device_id, "")], nixl_memory_type) +
        # register_memory(descs, backends=self.nixl_backends).
        stage(st, "register_kv", lambda: agent.register_memory(
            agent.get_reg_descs([(kv.data_ptr(), kv.numel(), dev_id, "")], kv_mem),
            backends=backends))
        # kvlease's, exactly: rank_leases.RankLeases.register (P's slot array)
        # and load_checks.LoadChecks.register_landing (D's landing buffers):
        # get_reg_descs([(addr, nbytes, 0, "")], "DRAM") +
        # register_memory(descs, backends=self.nixl_backends).
        stage(st, "register_dram", lambda: agent.register_memory(
            agent.get_reg_descs([(words.ctypes.data, words.nbytes, 0, "")], "DRAM"),
            backends=backends))
        ok_md, md = stage(st, "metadata", agent.get_agent_metadata)
    out["ready_s"] = round(time.monotonic() - t_start, 3)
    emit(
        "ready",
        md=base64.b64encode(md).decode() if ok and ok_md else None,
        kv_addr=kv.data_ptr(),
        dev_id=dev_id,
        words_addr=int(words.ctypes.data),
        **out,
    )

    line = sys.stdin.readline()
    if not line.strip():  # the orchestrator gave up on this setting
        sys.stdout.flush()
        os._exit(0)
    peer = json.loads(line)
    if ok and peer.get("md"):
        ok_load, name = stage(st, "load_remote_md",
                              lambda: agent.add_remote_agent(base64.b64decode(peer["md"])))
        if ok_load:
            name = name.decode() if isinstance(name, bytes) else name
            if role == "D":
                d_side(agent, api, np, torch, kv, kv_mem, dev_id, words, peer, name, st, out, args)
            else:
                p_side(agent, name, st, out, args)
    emit("result", **out)
    sys.stdin.readline()  # "exit": P keeps its memory registered until D is done
    sys.stdout.flush()
    os._exit(0)  # skip NIXL/UCX teardown: a hang there is not what this measures


def poll_notifs(agent, want: set[bytes], deadline: float, got: dict) -> None:
    while time.monotonic() < deadline:
        for sender, msgs in agent.get_new_notifs().items():
            got.setdefault(sender if isinstance(sender, str) else sender.decode(), []).extend(msgs)
        if want <= {m for msgs in got.values() for m in msgs}:
            return
        time.sleep(0.001)


def p_side(agent, d_name, st, out, args) -> None:
    # P -> D standalone notification (vLLM's P sends none in pull mode; this
    # checks the reverse path of the same connection set).
    stage(st, "notif_p2d_send", lambda: agent.send_notif(d_name, notif_msg=P_TO_D))
    got: dict[str, list[bytes]] = {}
    t0 = time.monotonic()
    # D posts its READs at once, waits up to --timeout for them, then sends HB.
    poll_notifs(agent, {READ_DONE, HEARTBEAT}, t0 + 2 * args.timeout + 2, got)
    seen = [m for msgs in got.values() for m in msgs]
    out["p_received"] = {k: [m.decode("utf-8", "replace") for m in v] for k, v in got.items()}
    out["read_done_notif"] = READ_DONE in seen
    out["notif_d2p"] = HEARTBEAT in seen
    out["p_wait_s"] = round(time.monotonic() - t0, 3)


def d_side(agent, api, np, torch, kv, kv_mem, dev_id, words, peer, p_name, st, out, args) -> None:
    reads = {}  # name -> (handle, posted at)
    for k in ("vram_read", "dram_read"):
        out[k] = {"result": "not run"}
    p_regs = peer.get("stages", {})
    d_regs = st

    def kv_read():
        # vLLM's pull worker: Nx3 (addr, len, device id) lists, prepared once
        # per side (prep_xfer_dlist "NIXL_INIT_AGENT" / remote agent name),
        # then make_prepped_xfer("READ", ..., notif_msg=read-done) + transfer.
        local = np.array([(kv.data_ptr() + i * BLOCK_BYTES, BLOCK_BYTES, dev_id)
                          for i in range(len(READ_INTO))], dtype=np.uint64)
        remote = np.array([(peer["kv_addr"] + i * BLOCK_BYTES, BLOCK_BYTES, peer["dev_id"])
                           for i in range(N_BLOCKS)], dtype=np.uint64)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(local, kv_mem))
        rh = agent.prep_xfer_dlist(p_name, agent.get_xfer_descs(remote, kv_mem))
        h = agent.make_prepped_xfer("READ", lh, READ_INTO, rh, READ_FROM, notif_msg=READ_DONE)
        return h, agent.transfer(h)

    def slot_read():
        # kvlease's slot READ, exactly (load_checks.LoadChecks._post):
        # get_xfer_descs([(addr, n, 0)], "DRAM") both sides,
        # initialize_xfer("READ", local, remote, P's name) + transfer.
        local = agent.get_xfer_descs([(words.ctypes.data + LANDING_AT * 8, 8, 0)], "DRAM")
        slot = N_SLOTS + 1 if args.negative_control else SLOT  # control: past the region
        remote = agent.get_xfer_descs([(peer["words_addr"] + slot * 8, 8, 0)], "DRAM")
        h = agent.initialize_xfer("READ", local, remote, p_name)
        return h, agent.transfer(h)

    for name, fn, regs in (("vram_read", kv_read, "register_kv"),
                           ("dram_read", slot_read, "register_dram")):
        if not (p_regs.get(regs, {}).get("ok") and d_regs.get(regs, {}).get("ok")):
            out[name] = {"result": "skipped: registration failed"}
            continue
        t0 = time.perf_counter()
        ok, hs = stage(st, name + "_post", fn)
        if not ok:
            out[name] = {"result": "failed", "error": st[name + "_post"]["error"]}
            continue
        handle, state = hs
        reads[name] = [handle, state, t0, None]

    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline and any(r[1] == "PROC" for r in reads.values()):
        for r in reads.values():
            if r[1] == "PROC":
                try:
                    r[1] = agent.check_xfer_state(r[0])
                except Exception as e:
                    r[1] = "ERR"
                    r[3] = err(e)
        time.sleep(0.0005)
    for name, (handle, state, t0, e) in reads.items():
        ms = round((time.perf_counter() - t0) * 1e3, 3)
        if state == "DONE":
            out[name] = {"result": "ok", "ms": ms}
        elif state == "PROC":
            out[name] = {"result": "timeout", "error": f"still PROC after {args.timeout} s"}
        else:
            out[name] = {"result": "failed", "error": e or f"state {state}"}
        try:
            agent.release_xfer_handle(handle)
        except Exception as e2:
            out[name]["release_error"] = err(e2)

    if out["vram_read"]["result"] == "ok":
        if kv.device.type == "cuda":
            torch.cuda.synchronize()
        want = kv_pattern(torch, torch.device("cpu"), N_BLOCKS).view(N_BLOCKS, BLOCK_BYTES)[READ_FROM]
        got = kv.cpu().view(len(READ_INTO), BLOCK_BYTES)
        bad = int((got != want).sum())
        if bad:
            out["vram_read"] = {"result": "wrong bytes", "error": f"{bad} of {got.numel()} bytes differ"}
    if out["dram_read"]["result"] == "ok":
        w = [int(x) for x in words]
        expect = [LANDING_FILL] * LANDING_WORDS
        expect[LANDING_AT] = NONCE
        if w != expect:
            out["dram_read"] = {"result": "wrong bytes",
                                "error": f"landing words {[hex(x) for x in w]}, want nonce "
                                         f"{NONCE:#x} at word {LANDING_AT} only"}
        else:
            out["dram_read"]["nonce"] = hex(w[LANDING_AT])

    stage(st, "notif_d2p_send", lambda: agent.send_notif(p_name, notif_msg=HEARTBEAT))
    got: dict[str, list[bytes]] = {}
    poll_notifs(agent, {P_TO_D}, time.monotonic() + args.timeout, got)
    out["d_received"] = {k: [m.decode("utf-8", "replace") for m in v] for k, v in got.items()}
    out["notif_p2d"] = any(P_TO_D in v for v in got.values())


# --------------------------------------------------------------------------
# orchestrator


class Child:
    def __init__(self, role: str, env: dict, args, err_none: bool) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role,
               "--timeout", str(args.timeout), "--device", str(args.device)]
        if args.cpu_dry_run:
            cmd.append("--cpu-dry-run")
        if args.negative_control:
            cmd.append("--negative-control")
        if err_none:
            cmd.append("--ucx-err-none")
        self.role = role
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.msgs: queue.Queue = queue.Queue()
        self.tail: collections.deque = collections.deque(maxlen=40)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                try:
                    self.msgs.put(json.loads(line[len(MARK):]))
                except ValueError:
                    self.tail.append(line.rstrip())
            else:
                self.tail.append(line.rstrip())
        self.msgs.put(None)  # EOF

    def expect(self, kind: str, deadline: float) -> dict:
        """The next message of ``kind``, or a synthetic one saying why none came."""
        while True:
            try:
                m = self.msgs.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return {"kind": "hung", "error": f"no '{kind}' from {self.role} in time"}
            if m is None:
                rc = self.proc.wait()
                return {"kind": "died", "error": f"{self.role} exited with {rc} before '{kind}'"}
            if m.get("kind") in (kind, "fatal"):
                return m

    def send(self, obj) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) if obj is not None else "") + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def finish(self) -> int | None:
        self.send({"kind": "exit"})
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()
            return None


def ib_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def run_setting(setting: str, args) -> dict:
    row: dict = {"ucx_tls": label(setting)}
    err_none = setting.endswith(ERR_NONE)
    tls = setting[: -len(ERR_NONE)] if err_none else setting
    row["ucx_error_handling_mode"] = "none" if err_none else "vLLM default"
    named = {t.strip().lstrip("^") for t in tls.split(",") if t.strip()}
    ib = sorted(named & IB_TRANSPORTS)
    if ib and not ib_devices() and not tls.startswith("^"):
        row["status"] = f"skipped: {','.join(ib)} needs an RDMA device; /sys/class/infiniband has none"
        return row
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    if tls:
        env["UCX_TLS"] = tls
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    p = Child("P", env, args, err_none)
    d = Child("D", env, args, err_none)
    fatal = None
    try:
        ready_by = time.monotonic() + args.start_timeout
        rp, rd = p.expect("ready", ready_by), d.expect("ready", ready_by)
        row["P_ready"], row["D_ready"] = ({k: v for k, v in m.items() if k != "md"} for m in (rp, rd))
        for m in (rp, rd):
            if m["kind"] == "fatal":
                fatal = m["error"]
        if rp["kind"] != "ready" or rd["kind"] != "ready":
            row["status"] = "error: " + "; ".join(
                m["error"] for m in (rp, rd) if m["kind"] != "ready")
            p.send(None), d.send(None)
        else:
            p.send(rd), d.send(rp)
            done_by = time.monotonic() + 2 * args.timeout + 15
            row["P"], row["D"] = p.expect("result", done_by), d.expect("result", done_by)
            bad = [m for m in (row["P"], row["D"]) if m["kind"] != "result"]
            for m in bad:
                if m["kind"] == "fatal":
                    fatal = m["error"]
            row["status"] = "ran" if not bad else "error: " + "; ".join(m["error"] for m in bad)
    finally:
        row["rc"] = {"P": p.finish(), "D": d.finish()}
        row["log_tail"] = {"P": list(p.tail), "D": list(d.tail)}
        row["wall_s"] = round(time.monotonic() - t0, 2)
    if fatal:
        row["fatal"] = fatal
    summarize(row)
    return row


def summarize(row: dict) -> None:
    """The table's cells, from the two children's records."""
    s = row["summary"] = {}
    regs = []
    for side in ("P", "D"):
        stages = (row.get(side) or {}).get("stages") or (row.get(side + "_ready") or {}).get("stages") or {}
        for key, what in (("agent", "agent"), ("register_kv", "KV"), ("register_dram", "DRAM")):
            r = stages.get(key)
            if r is not None and not r["ok"]:
                regs.append(f"{side} {what}: {r['error']}")
        if not stages:
            regs.append(f"{side}: no record")
    s["registration"] = ("ok" if not regs else
                         "agent failed" if any(" agent: " in e for e in regs) else "failed")
    s["registration_errors"] = regs
    d = row.get("D") or {}
    p = row.get("P") or {}
    for key in ("vram_read", "dram_read"):
        r = d.get(key)
        s[key] = r["result"] if r else "not run"
        if r and r.get("error"):
            s[key + "_error"] = r["error"]
    s["read_done_notif"] = _yn(p.get("read_done_notif"))
    s["notif_d2p"] = _yn(p.get("notif_d2p"), (d.get("stages") or {}).get("notif_d2p_send"))
    s["notif_p2d"] = _yn(d.get("notif_p2d"), (p.get("stages") or {}).get("notif_p2d_send"))
    s["hazard"] = s["vram_read"] == "ok" and s["dram_read"] != "ok"
    # UCX's and NIXL's own error lines (UCX "... UCX  ERROR ...", glog "E...").
    errs = []
    for side, lines in (row.get("log_tail") or {}).items():
        for ln in lines:
            if "UCX  ERROR" in ln or re.match(r"E\d{4} ", ln):
                msg = ln.split("]", 2)[-1].strip() if "UCX  ERROR" in ln else ln.split("] ", 1)[-1]
                if f"{side}: {msg}" not in errs and f"P: {msg}" not in errs:
                    errs.append(f"{side}: {msg}"[:300])
    s["log_errors"] = errs[:4]


def _yn(received, sent=None) -> str:
    if sent is not None and not sent.get("ok"):
        return "send failed"
    if received is None:
        return "not run"
    return "ok" if received else "not received"


def print_table(rows: list[dict], mode: str) -> None:
    for r in rows:
        x = r.get("D") or r.get("D_ready") or {}
        if x.get("nixl_module"):
            print(f"nixl {x['nixl_module']}, UCX {x.get('ucx_version')}, torch {x.get('torch')} "
                  f"(CUDA {x.get('torch_cuda')}), {x.get('gpu', 'no GPU')}, KV in {x.get('kv_mem')}")
            break
    cols = ["UCX_TLS", "registration", "KV READ (" + mode + ")", "DRAM slot READ",
            "read-done", "notif D->P", "notif P->D", "s"]
    table = []
    for r in rows:
        s = r.get("summary")
        if s is None:
            table.append([r["ucx_tls"], r["status"].split(":")[0], "", "", "", "", "", ""])
            continue
        table.append([r["ucx_tls"], s["registration"], s["vram_read"], s["dram_read"],
                      s["read_done_notif"], s["notif_d2p"], s["notif_p2d"], str(r.get("wall_s", ""))])
    w = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print(" | ".join(c.ljust(w[i]) for i, c in enumerate(cols)))
    print("-+-".join("-" * x for x in w))
    for t in table:
        print(" | ".join(c.ljust(w[i]) for i, c in enumerate(t)))
    for r in rows:
        s = r.get("summary") or {}
        notes = list(s.get("registration_errors", []))
        notes += [f"{k[:-6]}: {v}" for k, v in s.items() if k.endswith("_error")]
        notes += [f"log {e}" for e in s.get("log_errors", [])]
        if r.get("status", "ran") != "ran":
            notes.insert(0, r["status"])
        if s.get("hazard"):
            notes.insert(0, "HAZARD: KV READ ok but the DRAM slot READ is not: every lease check would fail")
        for n in notes:
            print(f"  [{r['ucx_tls']}] {n}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the full results here")
    ap.add_argument("--tls", action="append",
                    help='a UCX_TLS setting ("" or "default" = unset); repeat; default: the survey list')
    ap.add_argument("--timeout", type=float, default=8.0,
                    help="seconds a READ, or a notification, may take (default 8)")
    ap.add_argument("--start-timeout", type=float, default=90.0,
                    help="seconds a process may take to import torch/nixl, register and export (default 90)")
    ap.add_argument("--device", type=int, default=0, help="CUDA device of both agents (default 0)")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help='no GPU: KV blocks in DRAM registered as "DRAM"; the same flow otherwise')
    ap.add_argument("--negative-control", action="store_true",
                    help="D's slot READ targets a word past P's registered slot array: "
                         "the DRAM column must then show a failure and HAZARD (a check of the script)")
    ap.add_argument("--role", choices=["P", "D"], help=argparse.SUPPRESS)
    ap.add_argument("--ucx-err-none", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.role:
        try:
            return child(args.role, args)
        except Exception:
            emit("fatal", error=traceback.format_exc()[-2000:])
            return 2

    settings = args.tls if args.tls else (DRY_SETTINGS if args.cpu_dry_run else GPU_SETTINGS)
    settings = ["" if s in ("", "default", "(unset)") else s for s in settings]
    settings = [ERR_NONE if s in ("default" + ERR_NONE, "(unset)" + ERR_NONE) else s for s in settings]
    mode = "DRAM, dry run" if args.cpu_dry_run else "VRAM"
    t0 = time.monotonic()
    rows = []
    for tls in settings:
        print(f"== UCX_TLS={label(tls)}", flush=True)
        rows.append(run_setting(tls, args))
        if rows[-1].get("fatal"):
            print("script error: the other settings are not run", flush=True)
            break
    print()
    print_table(rows, mode)
    fatal = [r for r in rows if r.get("fatal")]
    report = {
        "what": "NIXL READs of VRAM KV blocks and a DRAM lease-slot word between two agents "
                "(two processes) on one GPU, per UCX_TLS (kvlease issue 28 item 4)",
        "mode": ("cpu-dry-run (KV in DRAM)" if args.cpu_dry_run else "gpu")
                + (", negative control (slot READ past the registered region)" if args.negative_control else ""),
        "timeout_s": args.timeout,
        "block_bytes": BLOCK_BYTES,
        "blocks_read": len(READ_FROM),
        "wall_s": round(time.monotonic() - t0, 2),
        "ib_devices": ib_devices(),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("UCX_", "NIXL_", "CUDA_VISIBLE"))},
        "results": rows,
        "script_errors": [r["fatal"] for r in fatal],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")
    print(f"{len(rows)} settings in {report['wall_s']} s")
    if fatal:
        print("script error (not a transport result):", fatal[0]["fatal"], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
