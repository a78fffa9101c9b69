#!/bin/sh
# The one command to run on a GPU machine lent for a few minutes (docs/benchmarks.md,
# "Budgeted GPU run"): from the repository root, with the Python already there, no network,
#
#     sh benchmarks/gpu_session.sh
#
# 1. installs the GPU tests' wheels offline (tests/gpu/wheels -> .gpu-site, on PYTHONPATH);
# 2. runs benchmarks/gpu_report.py --budget-s $GPU_BUDGET_S (default 450): the GPU tests of
#    the paths that never ran on a GPU first, then FP8 KV, async scheduling, the quantized
#    paths, speculative decoding, structured outputs, the profile, and the transformers sweep
#    with what is left; each section is written under $OUT/gpu-report/ as soon as it ends;
# 3. a hard limit of the budget plus 60 s (timeout): a killed run keeps what it wrote.
#
# Everything lands under $OUT (the device tool's output folder; default ./gpu-session). On an
# H100/H200 the whole command takes at most GPU_BUDGET_S + about 30 s of imports and wheel
# install: 8 minutes with the default, which leaves a 15-minute lease time to start the
# machine and to rerun. Extra gpu_report.py options: GPU_REPORT_ARGS="--model /path ...".
set -u
OUT=${OUT:-gpu-session}
BUDGET_S=${GPU_BUDGET_S:-450}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
{
    echo "start: $(date -u)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
} > "$OUT/session.log"
sh tests/gpu/offline_wheels.sh "$PYTHON" .gpu-site >> "$OUT/session.log" 2>&1 \
    || echo "offline wheels failed: structured-output tests will skip" >> "$OUT/session.log"
# shellcheck disable=SC2086  # GPU_REPORT_ARGS is a list of options
PYTHONPATH=src:.gpu-site timeout -k 10 $((BUDGET_S + 60)) "$PYTHON" benchmarks/gpu_report.py \
    --budget-s "$BUDGET_S" \
    --out "$OUT/gpu-report.md" \
    --out-dir "$OUT/gpu-report" \
    --num-requests 128 \
    --async-rounds 1 \
    --spec-rounds 1 \
    --tests-timeout 180 \
    ${GPU_REPORT_ARGS:-} > "$OUT/gpu-report.log" 2>&1
status=$?
echo "gpu_report.py exit status $status; end: $(date -u)" >> "$OUT/session.log"
tail -n 30 "$OUT/gpu-report.md" 2>/dev/null || tail -n 60 "$OUT/gpu-report.log"
exit $status
