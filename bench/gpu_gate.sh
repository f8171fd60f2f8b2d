#!/usr/bin/env bash
# The GPU gate: freetoken-verify on CUDA over the bundled cases (fp32 against the stored golden;
# bf16 against HF bf16 on the same GPU, and the NVFP4 cases, which HF cannot load, in bf16
# against their stored golden and its stored bf16 baseline) and over qwen3.5-moe-realdims in
# bf16. Ranks use NCCL when there are as many GPUs as ranks and share GPUs over gloo otherwise
# (--oversubscribe). On CUDA it also runs the kernels check's GPU gate, the pytest tests marked
# `gpu` in tests/gpu (JUnit in REPORT_DIR/kernels-gpu.xml). DEVICE=cpu runs the same gate on CPU
# ranks (a dry run of the script, without the GPU tests).
#
#   TP=1,2,4,8 PYTHON=python3 [PART=bundled|realdims|kernels] [DEVICE=cuda|cpu] \
#       bash bench/gpu_gate.sh REPORT_DIR [REALDIMS_DIR]
#
# Writes one JSON report per run into REPORT_DIR; exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TP=${TP:-1,2}
DEVICE=${DEVICE:-cuda}
REPORTS=${1:?usage: gpu_gate.sh REPORT_DIR [REALDIMS_DIR]}
REALDIMS=${2:-$(mktemp -d)/qwen3.5-moe-realdims}
PART=${PART:-all}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$REPORTS"
status=0

verify() {
    local name=$1
    shift
    echo "=== $name: freetoken-verify $*"
    "$PY" -m verify.cli --device "$DEVICE" --oversubscribe --tp "$TP" "$@" \
        --report-json "$REPORTS/$name.json" --junit-xml "$REPORTS/$name.xml" || status=1
}

cases() {  # bundled case names, comma separated: unquantized (hf) or NVFP4 (nvfp4)
    "$PY" -c "from verify.cases import CASES
print(','.join(n for n, c in sorted(CASES.items()) if c.nvfp4 == ('$1' == 'nvfp4')))"
}

if [ "$DEVICE" = cuda ] && [[ $PART == all || $PART == kernels ]]; then
    echo "=== kernels-gpu: pytest -m gpu tests/gpu"
    "$PY" -m pytest -q -m gpu tests/gpu --junit-xml "$REPORTS/kernels-gpu.xml" || status=1
fi
if [[ $PART == all || $PART == bundled ]]; then
    verify bundled-fp32
    verify bundled-bf16 --dtype bfloat16 --reference hf --checks golden --model "$(cases hf)"
    verify bundled-nvfp4-bf16 --dtype bfloat16 --checks golden --model "$(cases nvfp4)"
fi
if [[ $PART == all || $PART == realdims ]]; then
    [ -f "$REALDIMS/config.json" ] || "$PY" -m verify.cases --realdims "$REALDIMS" --dtype bfloat16
    verify realdims-bf16 --model "$REALDIMS" --dtype bfloat16 --reference hf \
        --checks golden,memory,shards
    verify realdims-fp32 --model "$REALDIMS" --dtype float32 --reference hf --checks golden
fi
exit $status
