#!/usr/bin/env bash
# The GPU gate, kept for existing callers: the runs live in the Makefile (`make verify-gpu`,
# docs/gpu.md), this passes the old variables through.
#
#   TP=1,2,4,8 PYTHON=python3 [PART=bundled|realdims|kernels] [DEVICE=cuda|cpu] \
#       bash bench/gpu_gate.sh REPORT_DIR [REALDIMS_DIR]
#
# Writes one JSON, JUnit and markdown report per run into REPORT_DIR; exits non-zero if any run
# failed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPORTS=${1:?usage: gpu_gate.sh REPORT_DIR [REALDIMS_DIR]}
exec make --no-print-directory verify-gpu REPORTS="$REPORTS" ${2:+REALDIMS="$2"} \
    TP="${TP:-1,2}" PYTHON="${PYTHON:-python3}" DEVICE="${DEVICE:-cuda}" PART="${PART:-all}"
