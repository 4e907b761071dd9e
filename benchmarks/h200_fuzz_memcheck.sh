#!/usr/bin/env bash
# Issue 20's GPU figures in one device call (< 10 minutes): the bf16 fuzzer in $FUZZ processes
# (disjoint seeds, a time budget each) beside compute-sanitizer memcheck over the whole GPU
# suite (tests/kernels: every kernel test, the real-size ones and the bad-value set with the
# value checks off) in $SHARDS shards (FLASHLSE_TEST_SHARD, tests/conftest.py), then the
# CUDA-graph tests without the sanitizer: its own legacy-stream wait breaks stream capture
# (RESULTS.md, session 8). Both are compile-bound: FUZZ + SHARDS should match the cores.
#   bash benchmarks/h200_fuzz_memcheck.sh                 # FUZZ=8 SHARDS=8 SECS=480
#   FUZZ=0 SHARDS=14 bash benchmarks/h200_fuzz_memcheck.sh  # memcheck alone
# Logs come back as two archives in $OUT (a device call returns at most 8 files).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/mc" "$OUT/fuzz"
SECS=${SECS:-480}; FUZZ=${FUZZ:-8}; SHARDS=${SHARDS:-8}; SEED0=${SEED0:-60000}
for i in $(seq 0 $((FUZZ - 1))); do
    timeout $((SECS + 30)) python3 -m tools.fuzz --device cuda --dtype bf16 --n 5000 \
        --seed $((SEED0 + i * 5000)) --seconds "$SECS" > "$OUT/fuzz/fuzz_$i.log" 2>&1 &
done
for i in $(seq 0 $((SHARDS - 1))); do
    FLASHLSE_TEST_SHARD=$i/$SHARDS timeout $((SECS + 40)) compute-sanitizer --tool memcheck \
        --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/kernels \
        -k "not graph_replay" > "$OUT/mc/mc_$i.log" 2>&1 &
done
wait
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_graphs.py \
    > "$OUT/mc/graphs.log" 2>&1
# A shard cut by its time budget prints no ERROR SUMMARY: count its reports and tests run.
for f in "$OUT"/mc/mc_*.log; do
    echo "$(basename "$f"): $(grep -E 'ERROR SUMMARY' "$f" | tail -1) | reports: $(grep -cE '^========= (Invalid|Program hit|Address|Out-of-range|Misaligned)' "$f") | $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"
done
echo "graphs (no sanitizer): $(tail -1 "$OUT/mc/graphs.log")"
grep -h "^FAILED\|^ERROR" "$OUT"/mc/*.log | head -20
grep -h "^FAIL" "$OUT"/fuzz/*.log | head -20
grep -h "^fuzz:" "$OUT"/fuzz/*.log
(cd "$OUT" && tar czf mc_logs.tgz mc && tar czf fuzz_logs.tgz fuzz && rm -rf mc fuzz)
