#!/usr/bin/env bash
# On the lent GPU machine, from the repo root: install the staged vLLM (the chunks carried in
# .stage/c*, or already in /tmp/atom-stage from an earlier call) and this package beside it, then
# run the given command with the environment vLLM needs there. The install log goes to $OUT.
#
#   bash deploy/gpu-dev/with_vllm.sh python3 -m pytest -q -m gpu integration_tests/test_serve_gpu.py
set -euo pipefail
STAGE=/tmp/atom-stage
mkdir -p "$STAGE"
for chunk in .stage/c*/; do
  [ -d "$chunk" ] && cp "$chunk"* "$STAGE"/
done
LOG="${OUT:-/tmp}/install.log"
if ! bash deploy/gpu-dev/install_vllm.sh "$STAGE" >> "$LOG" 2>&1; then
  tail -40 "$LOG" >&2
  exit 1
fi
# the package as users install it: its entry points are what vLLM loads
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/atom-site . >> "$LOG" 2>&1
export PYTHONPATH=/tmp/atom-site:/tmp/vllm-site PATH=/tmp/vllm-site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
exec "$@"
