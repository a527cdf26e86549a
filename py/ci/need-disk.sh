#!/usr/bin/env bash
# Fails early, and says why, when a disk lacks the room a step is about to
# fill: pip writing a multi-GiB venv into a full disk dies half-way with
# "[Errno 28] No space left on device" and leaves a broken venv behind.
#
#   py/ci/need-disk.sh DIR GIB WHAT      exit 0 when DIR's filesystem has GIB GiB free,
#                                        else print what needs the room and exit 1
#
# DIR need not exist yet: its nearest existing parent is measured.
set -euo pipefail
dir="$1" need_gib="$2" what="$3"
while [ ! -e "$dir" ]; do dir="$(dirname "$dir")"; done
free_kib="$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')"
need_kib=$(( need_gib * 1024 * 1024 ))
if [ "$free_kib" -lt "$need_kib" ]; then
    printf 'error: %s needs about %s GiB free on the disk of %s; it has %s GiB.\n' \
        "$what" "$need_gib" "$dir" "$(awk -v k="$free_kib" 'BEGIN { printf "%.1f", k / 1048576 }')" >&2
    printf '       Free some (the other venv, target/debug, ~/.cache/kvlease) or point the venv elsewhere.\n' >&2
    exit 1
fi
