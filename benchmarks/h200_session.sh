#!/usr/bin/env bash
# The first device call of a session (one H200, < 10 minutes): every kernel test on the GPU,
# the CUDA audit and the quick benchmarks. Logs land in $OUT (at most 8 files come back).
#   bash benchmarks/h200_session.sh            # tests + audit + quick benchmarks
#   bash benchmarks/h200_session.sh tables     # the full tables (bwd, decode with MLA, merge)
#   bash benchmarks/h200_session.sh sm90       # the Gluon backward kernels: tests + A/B table
#                                                (defaults against bwd.py's kernels alone)
#   bash benchmarks/h200_session.sh host [full] # public-call host time, sync-free tests, tables
#   bash benchmarks/h200_session.sh fuzz       # bf16 fuzz, NaN/sink tests, memcheck
#   bash benchmarks/h200_session.sh pending    # the GPU tests and benchmarks not yet run
#   bash benchmarks/h200_session.sh serving    # paged kernel tests, sweep, serving, host time
#   bash benchmarks/h200_session.sh verify|final|sparse   # session 9's checks
#   bash benchmarks/h200_session.sh decode     # session 10: decode-kernel tests, decode and
#                                                sparse tables before (.before) and after
#   bash benchmarks/h200_session.sh mla        # the Hopper MLA decode: GPU tests, bench_mla.py
#   bash benchmarks/h200_session.sh next       # session 12's pending checks: the MLA kernel's
#                                                sub-page tests and memcheck, then issue 21's
#                                                decode and merge tables before (.before: here
#                                                `bash benchmarks/before_after.sh prep 2dcb23b`, carried)
#                                                and after
#   bash benchmarks/h200_session.sh paged [varlen]  # session 13: the Hopper paged forward's
#                                                tests, the Hopper forwards' launches,
#                                                bench_serving (and bench_varlen.py)
#   bash benchmarks/h200_session.sh suite      # every GPU test, six shards (issue 21's bar)
#   bash benchmarks/h200_session.sh s22        # session 18's final tree: D = 64 persistent
#                                                and MLA page 8 GPU tests, host_varlen.py
#   bash benchmarks/h200_session.sh varlen-stats # varlen lse and delta by TMA: tests, memcheck,
#                                                bench_varlen against .before (carried)
#   bash benchmarks/h200_session.sh fused-bwd  # the fused backward (dQ by TMA reduces in the
#                                                dK/dV pass): its tests and memcheck
#   bash benchmarks/h200_session.sh fused-bench # bench_bwd, default against deterministic=True
#   bash benchmarks/h200_session.sh s21        # varlen dK/dV: descriptors made in parallel,
#                                                the key-block list; tests, bench_varlen before
#                                                / after (carry .before), FUSED_DQ A/B, memcheck
#   bash benchmarks/h200_session.sh next21     # session 21's leftovers: backward tests,
#                                                bench_varlen --model x3, host profile at 1k
#   bash benchmarks/h200_session.sh host21     # device-descriptor tests, cProfile of the host
#                                                time (issue 15), one bench_varlen draw
#   bash benchmarks/h200_session.sh host-desc  # dK/dV on host descriptors: tests, memcheck, A/B
#   bash benchmarks/h200_session.sh prof-src   # ncu source page of the fused backward kernel
#                                                (warp samples by instruction); bench_varlen
#                                                at uniform document lengths
#   bash benchmarks/h200_session.sh prof-bwd   # Nsight Compute: the backward's kernels beside
#                                                cuDNN's (benchmarks/ncu_bwd.py), S = 1k and 4k
#   bash benchmarks/h200_session.sh mla-ab     # session 12: the MLA decode's GPU tests, then
#                                                bench_mla.py (Gluon only) of the tree in
#                                                .before_mla (carried) and of this one, twice
#   (issue 20's figures: benchmarks/h200_fuzz_memcheck.sh, fuzz beside memcheck)
# Note: `-m gpu` alone selects only the real-size tests; the parametrized kernel tests
# (the same ones CI runs under the interpreter) run on CUDA too when no marker is given.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# gate LOG SECONDS PYTEST_ARGS...: a GPU test run first in a call (a hang shows within
# SECONDS), its summary and failures printed; non-zero unless every selected test passed.
gate() {
    local log=$OUT/$1 secs=$2; shift 2
    timeout "$secs" python3 -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
    echo "$(basename "$log"): $(tail -1 "$log")"
    grep -h "^FAILED\|^ERROR" "$log" | head
    grep -q " passed" "$log" && ! grep -q "failed\|error" "$log"
}
# bwd_checks NAME SECONDS KEXPR: test_bwd.py's tests selected by KEXPR (stopping at the first
# failure), then compute-sanitizer memcheck of the bad-data and windowed fused cases.
bwd_checks() {
    timeout "$2" python3 -m pytest -q -x tests/kernels/test_bwd.py -k "$3" \
        -p no:cacheprovider > "$OUT/test_$1.log" 2>&1
    echo "tests: $(tail -1 "$OUT/test_$1.log")"
    grep -h "^FAILED\|^E " "$OUT/test_$1.log" | head -20
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
        tests/kernels/test_bwd.py -k "bad_data or (fused and window)" -p no:cacheprovider \
        > "$OUT/memcheck_$1.log" 2>&1
    echo "memcheck rc=$?"; grep -h "ERROR SUMMARY" "$OUT/memcheck_$1.log" | tail -1
}
# fuzz_bf16 PROCS SEED0 SECONDS: the seeded fuzzer in bf16 on the GPU (bad-data draws
# included), PROCS processes side by side; prints any failure, then each one's summary.
fuzz_bf16() {
    local i
    for i in $(seq 0 $(($1 - 1))); do
        timeout $(($3 + 20)) python3 -m tools.fuzz --device cuda --dtype bf16 \
            --seed $(($2 + i * 5000)) --n 5000 --seconds "$3" > "$OUT/fuzz$i.log" 2>&1 &
    done
    wait
    grep -h "^FAIL" "$OUT"/fuzz*.log | head; grep -h "^fuzz:" "$OUT"/fuzz*.log
}
# An unknown mode is refused: it would otherwise run the whole default session.
if [ -n "${1:-}" ] && [[ " sm90 mla next paged s14 s22 s21 host21 next21 host-desc prof-src varlen-stats fused-bwd fused-bench prof-bwd suite mla-ab pending sparse decode final verify serving fuzz host tables " != *" $1 "* ]]; then
    echo "h200_session.sh: unknown mode '$1'" >&2; exit 2
fi
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
if [ "$1" = sm90 ]; then
    # The Gluon backward kernels (bwd_sm90.py): their GPU tests (and bwd.py's on the same
    # cases), then the D = 128 table with bwd.py's kernels alone beside the defaults.
    K=tests/kernels/test_bwd.py
    timeout 240 python3 -m pytest -q $K -k "sm90 and (bf16 or varlen)" -p no:cacheprovider \
        > "$OUT/test_sm90_a.log" 2>&1 &
    P1=$!
    timeout 240 python3 -m pytest -q $K -k "sm90 and fp16" -p no:cacheprovider \
        > "$OUT/test_sm90_b.log" 2>&1 &
    P2=$!
    wait $P1 $P2
    for f in "$OUT"/test_sm90_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_sm90_*.log | head
    timeout 280 python3 benchmarks/bench_bwd.py --quick --sm90 none --flex-budget 0 \
        --out "$OUT" 2>&1 | tail -22
    exit 0
fi
if [ "$1" = mla ]; then
    # Issue 18: the Hopper MLA decode's GPU tests (one case first: a hang shows in 2 minutes),
    # then benchmarks/bench_mla.py (Gluon and portable kernels through the public call).
    T=tests/kernels/test_decode_mla_sm90.py
    timeout 120 python3 -m pytest -q -x "$T::test_mla_sm90_matches_reference[contiguous]" \
        -p no:cacheprovider > "$OUT/test_mla0.log" 2>&1 || { tail -25 "$OUT/test_mla0.log"; exit 1; }
    timeout 240 python3 -m pytest -q $T tests/kernels/test_decode.py \
        tests/kernels/test_sparse_kernels.py -p no:cacheprovider > "$OUT/test_mla.log" 2>&1
    tail -1 "$OUT/test_mla.log"; grep -h "^FAILED" "$OUT/test_mla.log" | head
    timeout 200 python3 benchmarks/bench_mla.py --out "$OUT" > "$OUT/bench_mla.log" 2>&1
    tail -11 "$OUT/bench_mla.log"
    exit 0
fi
if [ "$1" = next ]; then
    T=tests/kernels/test_decode_mla_sm90.py
    K="paged16 or paged8 or paged32 or out_of_range"
    timeout 150 python3 -m pytest -q $T -k "$K" -p no:cacheprovider > "$OUT/test_subpage.log" 2>&1
    tail -1 "$OUT/test_subpage.log"; grep -h "^FAILED" "$OUT/test_subpage.log" | head
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q $T \
        -k "$K" -p no:cacheprovider > "$OUT/memcheck_subpage.log" 2>&1
    echo "memcheck rc=$?"; grep -h "ERROR SUMMARY" "$OUT/memcheck_subpage.log" | tail -1
    timeout 150 python3 benchmarks/bench_mla.py --gluon-only --pages 8,16,32,64 --out "$OUT" \
        > "$OUT/bench_pages.txt" 2>&1; tail -5 "$OUT/bench_pages.txt" | cut -c1-70
    PASSES=1 timeout 240 bash benchmarks/before_after.sh run decode merge 2>&1 | tail -40
    exit 0
fi
if [ "$1" = paged ]; then
    # Session 13: the Hopper paged forward and both Hopper forwards' tuple-stride launches:
    # their GPU tests beside the kvcache / launch / sync-free / CUDA-graph kernel tests, then
    # bench_serving (chunked prefill, mixed step) and the forward's host time.
    K=tests/kernels
    mkdir -p "$OUT/tests"
    timeout 300 python3 -m pytest -q $K/test_fwd_paged_sm90.py -p no:cacheprovider \
        > "$OUT/tests/paged.log" 2>&1 &
    timeout 300 python3 -m pytest -q $K/test_fwd.py -k "sm90 or gpu" -p no:cacheprovider \
        > "$OUT/tests/fwd.log" 2>&1 &
    for i in 0 1; do
        FLASHLSE_TEST_SHARD=$i/2 timeout 300 python3 -m pytest -q $K/test_kvcache_kernels.py \
            $K/test_launch_fast_path.py $K/test_sync_free.py $K/test_cuda_graphs.py \
            -p no:cacheprovider > "$OUT/tests/kv$i.log" 2>&1 &
    done
    wait
    for f in "$OUT"/tests/*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
    grep -h "^FAILED\|^ERROR" "$OUT"/tests/*.log | head -20
    (cd "$OUT" && tar czf tests.tgz tests && rm -rf tests)
    timeout 120 python3 benchmarks/bench_serving.py 2>&1 | tail -12
    timeout 90 python3 benchmarks/bench_overhead.py --functions fwd,varlen --out "$OUT" 2>&1 \
        | tail -6
    [ "$2" = varlen ] && timeout 120 python3 benchmarks/bench_varlen.py 2>&1 | tail -6
    exit 0
fi
if [ "$1" = s14 ]; then
    # Session 14: the empty-block sink fix's GPU tests (both Hopper forwards, the kernels),
    # bench_serving, then issue 18's top-k producer A/B: the tree in .before_mla (carried;
    # 4 producer warps of 24 registers) against this one (2 of 56), bench_mla --topk-only and
    # bench_sparse (MLA prefill on the same kernel), alternating.
    K=tests/kernels
    timeout 200 python3 -m pytest -q $K/test_fwd_paged_sm90.py -k sink_and_nan \
        -p no:cacheprovider > "$OUT/test_paged.log" 2>&1 &
    timeout 200 python3 -m pytest -q $K/test_nan_kernels.py -p no:cacheprovider \
        > "$OUT/test_nan.log" 2>&1 &
    wait
    for f in "$OUT"/test_*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
    grep -h "^FAILED\|^ERROR" "$OUT"/test_*.log | head -20
    timeout 120 python3 benchmarks/bench_serving.py 2>&1 | tail -12
    for pass in 1 2; do
        for tree in variant shipped; do
            root=$PWD; [ $tree = variant ] && root=$PWD/.before_mla
            PYTHONPATH=$root timeout 100 python3 "$root/benchmarks/bench_mla.py" --gluon-only \
                --topk-only --out "/tmp/mla_$tree" > "$OUT/mla_${tree}$pass.txt" 2>&1
            echo "== mla $tree $pass"; tail -4 "$OUT/mla_${tree}$pass.txt" | cut -c1-110
            PYTHONPATH=$root timeout 100 python3 "$root/benchmarks/bench_sparse.py" \
                > "$OUT/sparse_${tree}$pass.txt" 2>&1
            echo "== sparse $tree $pass"; cat "$OUT/sparse_${tree}$pass.txt" | cut -c1-200
        done
    done
    exit 0
fi
if [ "$1" = s22 ]; then
    # Session 18's final tree: the persistent forward at D = 64 (FWD_SM90[64], grid calls on
    # fwd.py's), the MLA decode at page 8 on two producer warps; the varlen forward's host
    # time with its list launch (benchmarks/host_varlen.py).
    gate s22.log 300 tests/kernels/test_fwd.py tests/kernels/test_decode_mla_sm90.py \
        tests/kernels/test_sync_free.py -k "d64 or attn_fwd_gpu_head_dims or paged8 or \
        paged16 or sync"
    timeout 60 python3 benchmarks/host_varlen.py 2>&1 | tail -4
    exit 0
fi
# ncu_source TAG: the fused dK/dV/dQ kernel's ncu source page (warp samples by instruction)
# at causal S = 1k, B*S = 16k, H = 16, summarised (ncu_bwd.py --source, --read); the report
# itself is removed (MBs), its CSVs stay in $OUT.
ncu_source() {
    timeout 200 ncu --profile-from-start off -k regex:_dkdv_sm90 -c 1 --set full \
        --import-source yes -f -o "$OUT/$1" python3 benchmarks/ncu_bwd.py --run \
        > "$OUT/ncu_run_$1.log" 2>&1; echo "ncu rc=$?"
    ncu -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1_sass.csv" \
        2> "$OUT/ncu_src_$1.err"
    python3 benchmarks/ncu_bwd.py --source "$OUT/$1_sass.csv" 2>&1 | head -75
    ncu -i "$OUT/$1.ncu-rep" --page details --csv > "$OUT/$1_details.csv" 2>&1
    python3 benchmarks/ncu_bwd.py --read "$OUT/$1_details.csv" 2>&1 | tail -3
    rm -f "$OUT/$1.ncu-rep"
}
if [ "$1" = next21 ]; then
    # What session 21 left for the next one's first call: the backward GPU tests on this
    # tree (SM90 bf16 cases, host / per-program equality, varlen), bench_varlen --model at
    # three draws (the varlen forward and backward against the dense kernel on each
    # document's length), then the fwd+bwd host profile at S = 1k again.
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_bwd.py \
        -k "(test_attn_bwd_gpu_sm90[ and bf16 and not tl) or host_descriptors or gpu_varlen" \
        > "$OUT/test_next21.log" 2>&1
    echo "tests: $(tail -1 "$OUT/test_next21.log")"
    grep -h "^FAILED\|^E " "$OUT/test_next21.log" | head
    for seed in 0 1 3; do
        timeout 90 python3 benchmarks/bench_varlen.py --seed $seed --model 2>&1 \
            | grep -E "attention|ratio|model" | cut -c1-120
    done
    timeout 60 python3 benchmarks/profile_host.py --rows "B=16" --top 40 > "$OUT/prof_1k.txt" 2>&1
    grep "===" "$OUT/prof_1k.txt"
    exit 0
fi
if [ "$1" = s21 ]; then
    # Session 21, issue 16: the varlen Hopper dK/dV (1) makes its descriptors in the producer
    # and the consumers at once (9 one after another -> 6; predicted +3-6% backward) and (2)
    # ran over a device-made list of its key blocks (VARLEN_LIST, since removed: slower).
    # Its GPU tests, bench_varlen of the tree in .before (carried; `before_after.sh prep
    # HEAD`) and of this one with a flag on / off at three draws, the fused pass against
    # the two-pass one now that both run on host descriptors (FUSED_DQ, S = 1k-4k), memcheck.
    timeout 300 python3 -m pytest -q -x tests/kernels/test_bwd.py tests/kernels/test_fuzz_kernels.py \
        -k "sm90 or varlen or uncovered or bad_data" -p no:cacheprovider > "$OUT/test_s21.log" 2>&1
    echo "tests: $(tail -1 "$OUT/test_s21.log")"
    grep -h "^FAILED\|^ERROR\|^E " "$OUT"/test_s21.log | head
    for seed in 0 1 3; do
        echo "== before seed $seed"
        PYTHONPATH=$PWD/.before timeout 60 python3 .before/benchmarks/bench_varlen.py \
            --seed $seed 2>&1 | grep -E "attention|ratio" | cut -c1-100
        echo "== after seed $seed"
        timeout 90 python3 benchmarks/bench_varlen.py --seed $seed ${VARLEN_FLAG:+--flag $VARLEN_FLAG} \
            2>&1 | grep -E "attention|ratio|backward," | cut -c1-110
    done
    timeout 120 python3 benchmarks/ab_bwd_switch.py --flag bwd_sm90.FUSED_DQ \
        --seqs 1024,2048,4096 2>&1 | tail -7
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
        tests/kernels/test_bwd.py -k "bad_data or (uncovered and hopper) or gpu_varlen" \
        -p no:cacheprovider > "$OUT/memcheck_s21.log" 2>&1
    echo "memcheck rc=$?"; grep -h "ERROR SUMMARY" "$OUT/memcheck_s21.log" | tail -1
    exit 0
fi
if [ "$1" = host21 ]; then
    # Session 21: the device-descriptor paths' tests again on the final tree (varlen, uncovered
    # rows, bad data, non-adjacent heads, host / per-program equality), then issue 15: where
    # the fwd+bwd's host time goes on this host (cProfile of the real launches, the small
    # shape and B = 16 S = 1k behind a GPU sleep), then issue 16: the varlen forward against
    # the dense kernel at each document's length (bench_varlen --model).
    timeout 150 python3 -m pytest -q tests/kernels/test_bwd.py tests/kernels/test_fuzz_kernels.py \
        -k "((varlen or uncovered or bad_data or head_major) and not tl) or host_descriptors" \
        -p no:cacheprovider > "$OUT/test_h21.log" 2>&1
    echo "tests: $(tail -1 "$OUT/test_h21.log")"
    grep -h "^FAILED\|^ERROR\|^E " "$OUT"/test_h21.log | head
    timeout 60 python3 benchmarks/profile_host.py --rows fwd+bwd --top 40 > "$OUT/prof_tot.txt" 2>&1
    grep "===" "$OUT/prof_tot.txt"
    timeout 60 python3 benchmarks/profile_host.py --rows "B=16" --top 40 --sort cumulative \
        > "$OUT/prof_cum.txt" 2>&1
    grep "===" "$OUT/prof_cum.txt"
    for seed in 0 3; do
        timeout 60 python3 benchmarks/bench_varlen.py --seed $seed --model 2>&1 \
            | grep -E "attention|ratio|model" | cut -c1-120
    done
    exit 0
fi
if [ "$1" = host-desc ]; then
    # Session 20: the dense Hopper dK/dV (fused and two-pass) on descriptors made on the host
    # (bwd_sm90.HOST_DESC). Its GPU tests (every SM90 case both ways, varlen on the device
    # descriptors, bad data) and a memcheck, then the A/B through the public call (on / off
    # in turn, cuDNN beside). Prediction: causal 1k +10-18%, 2k +6-10%, 4k+ +2-5%.
    bwd_checks host_desc 300 "sm90 or bad_data or gpu_varlen"
    timeout 200 python3 benchmarks/ab_bwd_switch.py --flag bwd_sm90.HOST_DESC 2>&1 | tail -10
    exit 0
fi
if [ "$1" = prof-src ]; then
    # Session 20: where the fused dK/dV/dQ kernel's warps wait, by instruction, then the
    # varlen forward at uniform document lengths against the dense kernel at the same S (its
    # own cost, apart from the mix).
    ncu_source fused1k
    for n in 512 1024 4096; do
        timeout 100 python3 benchmarks/bench_varlen.py --doc-len $n 2>&1 | grep -E "attention|ratio" \
            | cut -c1-100
    done
    exit 0
fi
if [ "$1" = varlen-stats ]; then
    # Session 20: varlen lse_log2 / delta rows start 16-byte aligned (stats_offset) and the
    # Hopper dK/dV (two-pass and fused) reads them by TMA. This tree's varlen backward GPU
    # tests and a memcheck, then bench_varlen of the tree in .before (carried; `before_after.sh
    # prep HEAD`) and of this one, alternating, at three document draws. Prediction: the
    # varlen backward 5-9% faster (seed 0: 0.76-0.83x -> 0.84-0.88x dense); forward unchanged.
    timeout 300 python3 -m pytest -q tests/kernels/test_bwd.py tests/kernels/test_fuzz_kernels.py \
        -k "varlen or uncovered or bad_data" -p no:cacheprovider > "$OUT/test_stats.log" 2>&1
    echo "tests: $(tail -1 "$OUT/test_stats.log")"
    grep -h "^FAILED\|^ERROR" "$OUT"/test_stats.log | head
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
        tests/kernels/test_bwd.py -k "bad_data or (uncovered and hopper)" -p no:cacheprovider \
        > "$OUT/memcheck_stats.log" 2>&1
    echo "memcheck rc=$?"; grep -h "ERROR SUMMARY" "$OUT/memcheck_stats.log" | tail -1
    for seed in 0 1 3; do
        for tree in before after; do
            root=$PWD; [ $tree = before ] && root=$PWD/.before
            echo "== $tree seed $seed"
            PYTHONPATH=$root timeout 100 python3 "$root/benchmarks/bench_varlen.py" --seed $seed \
                2>&1 | grep -E "attention|ratio" | cut -c1-100
        done
    done
    exit 0
fi
if [ "$1" = fused-bwd ]; then
    # The fused backward (dQ by TMA reduces in the dK/dV pass, the default since session 19):
    # its GPU tests (every SM90 case, its match with the two passes, varlen, bad data), then
    # memcheck of the fused cases.
    bwd_checks fused 330 "fused or gpu_sm90_varlen or gpu_varlen or bad_data or \
        (test_attn_bwd_gpu_sm90 and bf16)"
    exit 0
fi
if [ "$1" = fused-bench ]; then
    # What deterministic=True costs: bench_bwd --quick (D = 128, S = 1k-16k, full and
    # causal, peers in the same process) with the default (fused) and the two passes,
    # alternating. Session 19: 0-9%.
    for pass in 1 2; do
        for mode in default deterministic; do
            flag=; [ $mode = deterministic ] && flag=--deterministic
            timeout 150 python3 benchmarks/bench_bwd.py --quick --flex-budget 0 $flag \
                --out "/tmp/bwd_$mode" > "$OUT/bwd_${mode}$pass.txt" 2>&1
            echo "== $mode $pass"; grep "^D=128" "$OUT/bwd_${mode}$pass.txt" | cut -c1-120
        done
    done
    exit 0
fi
if [ "$1" = prof-bwd ]; then
    # Issue 22's backward gap, kernel by kernel against cuDNN's (one public fwd+bwd and one
    # cuDNN SDPA fwd+bwd each, causal at S = 1k and 4k, B*S = 16k, H = 16, D = 128).
    for s in 1024 4096; do
        timeout 240 ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
            --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
            --csv --page details python3 benchmarks/ncu_bwd.py --run --seqlen $s \
            > "$OUT/ncu_bwd_$s.csv" 2> "$OUT/ncu_bwd_$s.err"
        echo "== causal S=$s (rc $?)"
        python3 benchmarks/ncu_bwd.py --read "$OUT/ncu_bwd_$s.csv" | cut -c1-140
    done
    exit 0
fi
if [ "$1" = suite ]; then
    mkdir -p "$OUT/suite"
    # Twelve shards: at six, one ran past 540 s (session 14); at eight, three of them did
    # (session 19: the others took 480-530 s on the 16 cores).
    for i in $(seq 0 11); do
        FLASHLSE_TEST_SHARD=$i/12 timeout 550 python3 -m pytest -q tests -p no:cacheprovider \
            > "$OUT/suite/shard$i.log" 2>&1 &
    done
    wait
    for f in "$OUT"/suite/*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
    grep -h "^FAILED\|^ERROR" "$OUT"/suite/*.log | head -30
    (cd "$OUT" && tar czf suite.tgz suite && rm -rf suite)
    exit 0
fi
if [ "$1" = mla-ab ]; then
    T=tests/kernels/test_decode_mla_sm90.py
    timeout 120 python3 -m pytest -q -x "$T::test_mla_sm90_matches_reference[contiguous]" \
        -p no:cacheprovider > "$OUT/test_mla0.log" 2>&1 || { tail -25 "$OUT/test_mla0.log"; exit 1; }
    timeout 200 python3 -m pytest -q $T -p no:cacheprovider > "$OUT/test_mla.log" 2>&1
    tail -1 "$OUT/test_mla.log"; grep -h "^FAILED" "$OUT/test_mla.log" | head
    for pass in 1 2; do
        for tree in before after; do
            root=$PWD; [ $tree = before ] && root=$PWD/.before_mla
            PYTHONPATH=$root timeout 150 python3 "$root/benchmarks/bench_mla.py" --gluon-only \
                ${MLA_ARGS:-} --out "/tmp/mla_$tree" > "$OUT/mla_${tree}$pass.txt" 2>&1
            echo "== $tree $pass"; tail -10 "$OUT/mla_${tree}$pass.txt" | cut -c1-70
        done
        [ "${PASSES:-1}" = 1 ] && break
    done
    exit 0
fi
if [ "$1" = pending ]; then
    # What session 7 (2026-12-01) wrote without device time left: the GPU tests of the new
    # paths (sparse kernels incl. MLA and paged, SDPA routing, transformers in bf16, paged
    # varlen, kernel options), then their benchmarks through the public calls.
    K=tests/kernels
    timeout 300 python3 -m pytest -q $K/test_sparse_kernels.py $K/test_sdpa_impl.py \
        $K/test_integrations_gpu.py $K/test_kvcache_kernels.py $K/test_nan_kernels.py \
        -p no:cacheprovider > "$OUT/test_gpu_pending.log" 2>&1 &
    timeout 300 python3 -m pytest -q $K/test_fwd.py $K/test_bwd.py -k "sm90 or gpu" \
        -p no:cacheprovider > "$OUT/test_gpu_fwdbwd.log" 2>&1 &
    wait
    for f in "$OUT"/test_gpu_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_gpu_*.log | head -20
    timeout 100 python3 benchmarks/bench_sparse.py --backward 2>&1 | tail -4
    timeout 80 python3 benchmarks/bench_serving.py 2>&1 | tail -7
    timeout 60 python3 benchmarks/bench_sdpa.py 2>&1 | tail -3
    exit 0
fi
if [ "$1" = sparse ]; then
    # Session 9's unmeasured sparse forward (the decode kernel reading the top-k lists as its
    # table, contiguous and paged): GPU tests, then bench_sparse and the host-time row.
    timeout 200 python3 -m pytest -q tests/kernels/test_sparse_kernels.py \
        tests/test_sparse_attention.py -p no:cacheprovider > "$OUT/test_gpu_sparse.log" 2>&1
    tail -1 "$OUT/test_gpu_sparse.log"; grep -h "^FAILED" "$OUT/test_gpu_sparse.log" | head
    timeout 150 python3 benchmarks/bench_sparse.py --backward 2>&1 | tail -4
    timeout 100 python3 benchmarks/bench_overhead.py --functions sparse,kvcache --out "$OUT" \
        2>&1 | tail -8
    exit 0
fi
if [ "$1" = decode ]; then
    # Session 10: the decode kernel looks a paged tile's pages up one tile ahead. The GPU
    # tests of every path through that kernel (decode, kvcache, sparse forward, NaN and fuzz
    # cases, CUDA graphs, sync-free), then the decode and sparse tables of the tree before
    # (.before: `bash benchmarks/before_after.sh prep REV`, carried) and of this one.
    K=tests/kernels
    mkdir -p "$OUT/tests"
    timeout 230 python3 -m pytest -q $K/test_decode.py $K/test_combine.py $K/test_cuda_graphs.py \
        $K/test_sync_free.py -p no:cacheprovider > "$OUT/tests/gpu_a.log" 2>&1 &
    for i in 0 1; do
        FLASHLSE_TEST_SHARD=$i/2 timeout 230 python3 -m pytest -q $K/test_kvcache_kernels.py \
            -p no:cacheprovider > "$OUT/tests/gpu_kv$i.log" 2>&1 &
    done
    timeout 230 python3 -m pytest -q $K/test_sparse_kernels.py $K/test_nan_kernels.py \
        $K/test_fuzz_kernels.py -p no:cacheprovider > "$OUT/tests/gpu_b.log" 2>&1 &
    wait
    for f in "$OUT"/tests/*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
    grep -h "^FAILED\|^ERROR" "$OUT"/tests/*.log | head -20
    (cd "$OUT" && tar czf tests.tgz tests && rm -rf tests)
    for tree in before after; do
        root=$PWD; [ $tree = before ] && root=$PWD/.before
        echo "== $tree ($(cat .before/REV) / this tree)"
        PYTHONPATH=$root timeout 120 python3 "$root/benchmarks/bench_decode.py" --quick \
            --out "/tmp/bd_$tree" > "$OUT/decode_$tree.txt" 2>&1; tail -8 "$OUT/decode_$tree.txt"
        PYTHONPATH=$root timeout 120 python3 "$root/benchmarks/bench_sparse.py" \
            > "$OUT/sparse_$tree.txt" 2>&1; tail -4 "$OUT/sparse_$tree.txt"
    done
    exit 0
fi
if [ "$1" = final ]; then
    # Session 9's last call: the fast-path, decode and kvcache tests, the Hopper and real-size
    # forward/backward tests in three shards (kernel prologues refactored), then host time.
    K=tests/kernels
    timeout 240 python3 -m pytest -q $K/test_launch_fast_path.py $K/test_decode.py \
        $K/test_combine.py $K/test_kvcache_kernels.py -p no:cacheprovider > "$OUT/test_gpu_a.log" 2>&1 &
    for i in 0 1 2; do
        FLASHLSE_TEST_SHARD=$i/3 timeout 240 python3 -m pytest -q $K/test_fwd.py $K/test_bwd.py \
            -k "sm90 or gpu" -p no:cacheprovider > "$OUT/test_gpu_s$i.log" 2>&1 &
    done
    wait
    for f in "$OUT"/test_gpu_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED\|^ERROR" "$OUT"/test_gpu_*.log | head -20
    timeout 110 python3 benchmarks/bench_overhead.py --out "$OUT" 2>&1 | tail -16
    timeout 60 python3 benchmarks/profile_host.py --top 25 > "$OUT/profile_host.txt" 2>&1
    grep "===" "$OUT/profile_host.txt"
    exit 0
fi
if [ "$1" = verify ]; then
    # Session 9: the tests the default run's time cut (backward beyond dense/paths) and the
    # pending paths' tests in four processes, then the paged kernel and host-time benchmarks.
    K=tests/kernels
    FLASHLSE_TEST_SHARD=0/2 timeout 270 python3 -m pytest -q $K/test_bwd.py -k "not dense and not paths" \
        -p no:cacheprovider > "$OUT/test_gpu_bwd2a.log" 2>&1 &
    FLASHLSE_TEST_SHARD=1/2 timeout 270 python3 -m pytest -q $K/test_bwd.py -k "not dense and not paths" \
        -p no:cacheprovider > "$OUT/test_gpu_bwd2b.log" 2>&1 &
    timeout 270 python3 -m pytest -q $K/test_sparse_kernels.py $K/test_nan_kernels.py \
        -p no:cacheprovider > "$OUT/test_gpu_sparse.log" 2>&1 &
    timeout 270 python3 -m pytest -q $K/test_kvcache_kernels.py $K/test_sdpa_impl.py \
        $K/test_integrations_gpu.py -p no:cacheprovider > "$OUT/test_gpu_serving.log" 2>&1 &
    wait
    for f in "$OUT"/test_gpu_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED\|^ERROR" "$OUT"/test_gpu_*.log | head -20
    timeout 100 python3 benchmarks/sweep_paged.py 2>&1 | tail -14
    timeout 70 python3 benchmarks/bench_serving.py 2>&1 | tail -7
    timeout 90 python3 benchmarks/bench_overhead.py --out "$OUT" 2>&1 | tail -16
    exit 0
fi
if [ "$1" = serving ]; then
    # Session 8's unmeasured changes: the paged forward's pipelined loads (sweep_paged,
    # bench_serving), then host time a call (bench_overhead) after the Python cuts.
    timeout 200 python3 -m pytest -q tests/kernels/test_kvcache_kernels.py \
        tests/test_attention_varlen.py -p no:cacheprovider > "$OUT/test_gpu_paged.log" 2>&1
    tail -1 "$OUT/test_gpu_paged.log"; grep -h "^FAILED" "$OUT/test_gpu_paged.log" | head
    timeout 120 python3 benchmarks/sweep_paged.py 2>&1 | tail -14
    timeout 90 python3 benchmarks/bench_serving.py 2>&1 | tail -7
    timeout 100 python3 benchmarks/bench_overhead.py --out "$OUT" 2>&1 | tail -16
    exit 0
fi
if [ "$1" = fuzz ]; then
    # Bad-data honesty: the fuzzer in bf16 (four processes, disjoint seeds, a time budget
    # each), the NaN and -inf-sink kernel tests, and compute-sanitizer memcheck over the
    # kernel tests that feed out-of-range values with the value checks off.
    for i in 0 1 2 3; do
        timeout 460 python3 -m tools.fuzz --device cuda --dtype bf16 --n 1000 \
            --seed $((i * 1000)) --seconds 400 > "$OUT/fuzz_$i.log" 2>&1 &
    done
    timeout 300 python3 -m pytest -q tests/kernels/test_nan_kernels.py tests/kernels/test_sync_free.py \
        tests/kernels/test_fwd.py -k "sink or nan or window" -p no:cacheprovider \
        > "$OUT/test_gpu_nan.log" 2>&1
    tail -1 "$OUT/test_gpu_nan.log"; grep -h "^FAILED" "$OUT/test_gpu_nan.log" | head
    timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q \
        tests/kernels/test_kvcache_kernels.py -k "out_of_range or bad_offsets or long_queries" \
        -p no:cacheprovider > "$OUT/memcheck.log" 2>&1
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
    wait
    for i in 0 1 2 3; do tail -1 "$OUT/fuzz_$i.log"; done
    grep -h "^FAIL" "$OUT"/fuzz_*.log | head -20
    exit 0
fi
if [ "$1" = host ]; then
    # Public-call speed: where host time goes (cProfile), the kernels and sync-free tests of
    # the dispatch layer, then bench_overhead's table.
    timeout 120 python3 benchmarks/profile_host.py --top 22 > "$OUT/profile_host.txt" 2>&1
    grep "===" "$OUT/profile_host.txt"
    K=tests/kernels
    if [ "$2" = full ]; then
        timeout 200 python3 -m pytest -q $K/test_kvcache_kernels.py $K/test_sync_free.py \
            -p no:cacheprovider > "$OUT/test_gpu_serving.log" 2>&1
        tail -1 "$OUT/test_gpu_serving.log"
        timeout 100 python3 benchmarks/bench_overhead.py --out "$OUT" 2>&1 | tail -16
        timeout 240 python3 benchmarks/bench_decode.py --out "$OUT" 2>&1 | tail -8
        timeout 60 python3 benchmarks/bench_merge.py --out "$OUT" 2>&1 | tail -7
        timeout 60 python3 benchmarks/bench_serving.py 2>&1 | tail -6
        exit 0
    fi
    timeout 300 python3 -m pytest -q $K/test_kvcache_kernels.py $K/test_sync_free.py \
        $K/test_decode.py $K/test_cuda_graphs.py $K/test_combine.py -p no:cacheprovider \
        > "$OUT/test_gpu_serving.log" 2>&1 &
    timeout 300 python3 -m pytest -q $K/test_fwd.py $K/test_bwd.py -k "varlen" \
        -p no:cacheprovider > "$OUT/test_gpu_varlen.log" 2>&1 &
    timeout 300 python3 -m pytest -q tests/test_compile.py tests/test_attention.py \
        -p no:cacheprovider > "$OUT/test_gpu_ops.log" 2>&1 &
    wait
    for f in "$OUT"/test_gpu_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_gpu_*.log | head -20
    timeout 200 python3 benchmarks/bench_overhead.py --out "$OUT" 2>&1 | tail -16
    exit 0
fi
if [ "$1" = tables ]; then
    timeout 250 python3 benchmarks/bench_bwd.py --results --flex-budget 60 --out /tmp/bwd 2>&1 \
        | tail -36 > "$OUT/bench_bwd.txt"; cat "$OUT/bench_bwd.txt"
    timeout 200 python3 benchmarks/bench_decode.py --out "$OUT" 2>&1 | tail -10
    timeout 60 python3 benchmarks/bench_merge.py --out /tmp/merge 2>&1 | tail -7
    cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
    exit 0
fi
# All kernel tests compile many variants (over 8 minutes in one process): four processes
# share the 16 cores, about 4 minutes.
K=tests/kernels
run_tests() {  # log name, then pytest arguments
    local name=$1; shift
    timeout 380 python3 -m pytest -q "$@" -p no:cacheprovider > "$OUT/test_gpu_$name.log" 2>&1
}
run_tests fwd $K/test_fwd.py &
run_tests bwd1 $K/test_bwd.py -k "dense or paths" &
run_tests bwd2 $K/test_bwd.py -k "not dense and not paths" &
run_tests decode $K/test_decode.py $K/test_combine.py $K/test_cuda_graphs.py &
wait
for f in "$OUT"/test_gpu_*.log; do echo "$f: $(grep -E 'passed|failed|error' "$f" | tail -1)"; done
timeout 50 python3 -m flashlse audit --device cuda > "$OUT/audit_cuda.txt" 2>&1; head -14 "$OUT/audit_cuda.txt"
timeout 60 torchrun --nproc-per-node 1 benchmarks/bench_cp.py --seqlens 32768 --kind nvidia-h200 \
    2>&1 | grep -E "^S=|empty|check" | tail -4
timeout 70 python3 benchmarks/bench_decode.py --quick --out "$OUT" 2>&1 | tail -5
