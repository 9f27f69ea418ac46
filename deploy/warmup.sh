#!/bin/sh
# Pre-compiles every kernel variant into $ATOM_KERNEL_CACHE at image build time, so serving
# can run without a compiler pass on the first request (and with ATOM_NO_COMPILE=1).
# Usage: warmup.sh ARCH...   (sm_90a, gfx942, gfx950, ...). WARMUP_DRY_RUN=1 prints the command.
# ATOM_WARMUP_MODEL=/path/config.json (or a model directory) compiles only what that model needs;
# ATOM_WARMUP_ARGS adds flags (e.g. "--kv-dtype auto,fp8 --tp 2"). Unset: every declared variant.
# A package version without a warm-up command still builds: the kernels then compile on
# first use, and this says so.
set -eu
[ "$#" -gt 0 ] || { echo "usage: warmup.sh ARCH..." >&2; exit 2; }
PY="${PYTHON:-python3}"
args=""
for a in "$@"; do args="$args --arch $a"; done

has() { "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$1') else 1)" 2>/dev/null; }

if has atom_backend.catalog; then
    cmd="$PY -m atom_backend.catalog build$args"
    [ -n "${ATOM_WARMUP_MODEL:-}" ] && cmd="$cmd --model $ATOM_WARMUP_MODEL"
    [ -n "${ATOM_WARMUP_ARGS:-}" ] && cmd="$cmd $ATOM_WARMUP_ARGS"
elif has hip_kernels.variants; then
    cmd="$PY -m hip_kernels.variants$args"
else
    echo "atom-backend warm-up: this version has no kernel build command; kernels compile on first use"
    exit 0
fi
echo "atom-backend warm-up: $cmd"
[ "${WARMUP_DRY_RUN:-0}" = "1" ] && exit 0
# A warm-up that exists but fails is a broken image: fail the build.
exec $cmd
