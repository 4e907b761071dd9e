#!/usr/bin/env bash
# Issue 20's GPU figures in one device call (< 10 minutes): the bf16 fuzzer in six processes
# (disjoint seeds, a time budget each) beside compute-sanitizer memcheck over the GPU kernel
# tests in four processes (split by file). Logs in $OUT. MODE=memcheck: the whole GPU suite
# under memcheck in $SHARDS shards, no fuzzer.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SECS=${SECS:-430}
if [ "$MODE" = memcheck ]; then
    # The whole GPU suite (tests/kernels: every kernel test, the real-size ones and the
    # bad-value set with the value checks off) under memcheck in $SHARDS shards
    # (FLASHLSE_TEST_SHARD, tests/conftest.py), then the CUDA-graph tests without it: the
    # sanitizer's own legacy-stream wait breaks stream capture (RESULTS.md, session 8).
    SHARDS=${SHARDS:-14}
    for i in $(seq 0 $((SHARDS - 1))); do
        FLASHLSE_TEST_SHARD=$i/$SHARDS timeout "$SECS" compute-sanitizer --tool memcheck \
            --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/kernels \
            -k "not graph_replay" > "$OUT/mc_$i.log" 2>&1 &
    done
    wait
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_graphs.py \
        > "$OUT/graphs.log" 2>&1
    mkdir -p "$OUT/mc"; mv "$OUT"/mc_*.log "$OUT/mc/"
    for f in "$OUT"/mc/mc_*.log; do
        echo "$(basename "$f"): $(grep -E 'ERROR SUMMARY' "$f" | tail -1) | reports: $(grep -cE '^========= (Invalid|Program hit|Address|Out-of-range|Misaligned)' "$f") | $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"
    done
    echo "graphs (no sanitizer): $(tail -1 "$OUT/graphs.log")"
    grep -h "^FAILED\|^ERROR" "$OUT"/mc/mc_*.log "$OUT/graphs.log" | head -20
    (cd "$OUT" && tar czf mc_logs.tgz mc && rm -rf mc)
    exit 0
fi
for i in 0 1 2 3 4 5; do
    timeout $((SECS + 60)) python3 benchmarks/fuzz.py --device cuda --dtype bf16 --n 2000 \
        --seed $((40000 + i * 2000)) --seconds $SECS > "$OUT/fuzz_$i.log" 2>&1 &
done
K=tests/kernels
mc() {  # log name, then pytest arguments
    local name=$1; shift
    timeout $((SECS + 90)) compute-sanitizer --tool memcheck --print-limit 20 \
        python3 -m pytest -q -p no:cacheprovider "$@" > "$OUT/mc_$name.log" 2>&1
}
mc a $K/test_fwd.py $K/test_nan_kernels.py &
mc b $K/test_bwd.py &
mc c $K/test_decode.py $K/test_combine.py $K/test_kvcache_kernels.py $K/test_sync_free.py &
mc d $K/test_sparse_kernels.py $K/test_fuzz_kernels.py $K/test_cuda_graphs.py \
    $K/test_sdpa_impl.py $K/test_integrations_gpu.py &
wait
# A run cut by its time budget prints no ERROR SUMMARY: count the reports and the tests run.
for f in "$OUT"/mc_*.log; do
    echo "$f: $(grep -E 'ERROR SUMMARY' "$f" | tail -1) | reports: $(grep -cE '^========= (Invalid|Program hit|Address|Out-of-range|Misaligned)' "$f") | tests run: $(grep -E '^[.FEsx]+( |$)' "$f" | tr -cd '.FEsx' | wc -c) | $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -1)"
done
grep -h "^FAILED" "$OUT"/mc_*.log | head
cat "$OUT"/fuzz_*.log | grep -E "^fuzz:|^FAIL" | head -20
