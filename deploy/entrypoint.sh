#!/bin/sh
# Starts vLLM's OpenAI server with the atom-backend attention backend.
# PROMETHEUS_MULTIPROC_DIR makes vLLM's /metrics collect the engine-core and worker processes'
# atom_* series; prometheus-client needs it empty at start (stale files would add old counts).
set -eu
: "${PROMETHEUS_MULTIPROC_DIR:=/tmp/atom-prometheus}"
rm -rf "$PROMETHEUS_MULTIPROC_DIR"
mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
export PROMETHEUS_MULTIPROC_DIR
# Ours first: a later --attention-backend given by the operator wins (argparse keeps the last).
exec vllm serve --attention-backend CUSTOM "$@"
