#!/usr/bin/env bash
# On a machine with one NVIDIA GPU and CUDA-enabled torch: do kvlease's DRAM
# lease regions (P's slot array, D's slot-READ landing buffers) READ beside
# vLLM's VRAM KV cache, under each UCX_TLS setting? (issue 28 item 4;
# docs/vllm.md, "On a GPU: DRAM lease regions beside VRAM KV".)
#
#   bash py/engine/gpu/run.sh [WHEEL_DIR] [dram_beside_vram.py arguments...]
#   (e.g. run.sh "" --tls cuda_ipc,cuda_copy,tcp; run.sh "" --cpu-dry-run without a GPU)
#
# Installs nothing when `import nixl_cu13` works. Otherwise installs
# nixl==1.5.1 and nixl-cu13==1.5.1 (--no-deps) from WHEEL_DIR when given
# (no registry: pip --no-index --find-links), else from PyPI. Needs nothing
# of kvlease. Python: $PYTHON (default python3), the one with torch.
# Results: $OUT (default ./gpu-results): dram_beside_vram.json (the
# evidence), dram_beside_vram.txt (the table), env.txt. Takes about 1-3
# minutes; the survey is cut off after ${DBV_TIMEOUT:-300} s.
# Exit status: the script's (0 when the survey ran, whatever the
# transports did; 2 when the script itself failed; 124 when cut off).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
out="${OUT:-./gpu-results}"
mkdir -p "$out"

if ! "$py" -c 'import nixl_cu13' 2>/dev/null; then
    if [ -n "${1:-}" ]; then
        "$py" -m pip install -q --no-deps --no-index --find-links "$1" nixl==1.5.1 nixl-cu13==1.5.1
    else
        "$py" -m pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1
    fi
fi

{
    date -u
    if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1 || true; else echo "nvidia-smi: not found"; fi
    ls /sys/class/infiniband 2>/dev/null | sed 's/^/rdma device: /' || true
    env | grep -E '^(UCX_|NIXL_|CUDA_VISIBLE)' || true
    "$py" - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for d in ("nixl", "nixl-cu13", "nixl-cu12"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        pass
PY
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

set +e
timeout -k 10 "${DBV_TIMEOUT:-300}" "$py" "$here/dram_beside_vram.py" \
    --json "$out/dram_beside_vram.json" "${@:2}" 2>&1 | tee "$out/dram_beside_vram.txt"
rc=${PIPESTATUS[0]}
echo "exit status $rc; results in $out"
exit "$rc"
