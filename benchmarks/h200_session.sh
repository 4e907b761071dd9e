#!/usr/bin/env bash
# The first device call of a session (one H200, < 10 minutes): every kernel test on the GPU,
# the CUDA audit and the quick benchmarks. Logs land in $OUT (at most 8 files come back).
#   bash benchmarks/h200_session.sh            # tests + audit + quick benchmarks
#   bash benchmarks/h200_session.sh tables     # the full tables (bwd, decode with MLA, merge)
#   bash benchmarks/h200_session.sh sm90       # the Gluon backward kernels: tests + A/B table
#                                                (defaults against bwd.py's kernels alone)
#   bash benchmarks/h200_session.sh host [full] # public-call host time, sync-free tests, tables
#   bash benchmarks/h200_session.sh fuzz       # bf16 fuzz, NaN/sink tests, memcheck
#   bash benchmarks/h200_session.sh serving    # paged kernel tests, sweep, serving, host time
#   bash benchmarks/h200_session.sh mla        # the Hopper MLA decode: GPU tests, bench_mla.py
#   bash benchmarks/h200_session.sh paged [varlen]  # the Hopper paged forward's tests, the
#                                                Hopper forwards' launches, bench_serving
#                                                (and bench_varlen.py)
#   bash benchmarks/h200_session.sh suite      # every GPU test, twelve shards (issue 21's bar)
#   bash benchmarks/h200_session.sh host22     # session 22's first call: backward tests,
#                                                host profile, DescLaunch A/B, varlen model
#   bash benchmarks/h200_session.sh topk       # the top-k MLA decode: its GPU tests, bench_mla's
#                                                top-k rows (public call and graph), host us
#                                                of the top-k call against .before
#   bash benchmarks/h200_session.sh kept       # the kept plans of attention_with_kvcache,
#                                                merge_states and attention's forward: their
#                                                GPU tests, bench_overhead rows against .before
#                                                (before_after.sh prep REV) in turns
#   bash benchmarks/h200_session.sh raw        # raw launches of Gluon kernels: their GPU tests,
#                                                host us with RAW_LAUNCH on / off in turns
#   bash benchmarks/h200_session.sh sized      # the paged forward's length-free plan: its GPU
#                                                tests, host us of a moving decode step vs .before
#   bash benchmarks/h200_session.sh keep-ab    # host us with the kept plans on / off, in turns
#   bash benchmarks/h200_session.sh readme     # README's speed table: fwd / bwd / decode /
#                                                merge with peers, host us, one run
#   bash benchmarks/h200_session.sh readme2    # its D = 64 / 256 rows and decode at every B
#   bash benchmarks/h200_session.sh mla-why    # issue 18: the fixed cost's program sweep,
#                                                ncu over one and two MLA waves
#   bash benchmarks/h200_session.sh rebuild [FLAG]  # issue 18: MLA descriptors rebuilt in the
#                                                loop (A/B of decode_mla_sm90.FLAG, default
#                                                REBUILD_DESCRIPTORS, public calls), MLA tests
#   bash benchmarks/h200_session.sh paged-persistent  # issue 16: a paged call's long
#                                                sequences on the persistent varlen kernel
#                                                (fwd_sm90.PAGED_PERSISTENT): paged GPU tests
#                                                on both forms, bench_serving A/B
#   bash benchmarks/h200_session.sh paged-next # chunked prefill at 8k and at a 64k context
#                                                (32 and 8 query heads: one GPU of TP = 4),
#                                                the paged steps' host time
#   bash benchmarks/h200_session.sh split-kv   # key splits for few-item forwards
#                                                (fwd_sm90.PAGED_SPLIT_KV / VARLEN_SPLIT_KV):
#                                                GPU tests, memcheck, bench_serving A/B
#   bash benchmarks/h200_session.sh fused64    # D = 64's fused backward (FUSED_D64): its
#                                                tests, fwd+bwd on / off in turn
#   bash benchmarks/h200_session.sh mla-cost   # issue 18: the MLA decode's fixed cost a program
#                                                (mla_fixed_cost.py), MLA public rows, host us
#   bash benchmarks/h200_session.sh prof-src   # ncu source page of the fused backward kernel
#                                                (warp samples by instruction); bench_varlen
#                                                at uniform document lengths
#   bash benchmarks/h200_session.sh s44 tests  # session 43's lean forward (fwd_sm90.LEAN_MAX_D):
#                                                the Hopper forward tests and the paged file,
#                                                three processes (one call, < 10 min)
#   bash benchmarks/h200_session.sh s44 d256   # D = 256 with one half of the lean form each
#                                                (ROW_BOUNDS_MAX_D / EARLY_P_MAX_D = 256, trees
#                                                made on the device) against this tree
#   bash benchmarks/h200_session.sh s44 bench  # the forward table before / after the lean
#                                                form (before_after.sh prep 0b71d64, carry
#                                                .before), the paged steps' host us
#   bash benchmarks/h200_session.sh fused      # session 45's decode merge fused into the split
#                                                kernel (decode.FUSED_MERGE): GPU tests, host
#                                                us and device time on / off in turns
#   bash benchmarks/h200_session.sh s47        # sessions 46-47: unread lse, the token
#                                                table's fused merge, short queries on the
#                                                decode kernel (GPU tests, A/B), kvcache host us
#   bash benchmarks/h200_session.sh s48        # s47's tests and its short-query A/B, one call
#   bash benchmarks/h200_session.sh s49 [tf]   # session 48's leftovers: fixed tests, split floor
#   bash benchmarks/h200_session.sh s51 [d256] # paged varlen calls of uniform short rows on
#                                                the decode kernel (dispatch.PAGED_DECODE):
#                                                GPU tests, A/B, host us; then s44 d256
#   bash benchmarks/h200_session.sh s52        # s51's route, and a mixed step's decodes on
#                                                the decode kernel (dispatch.SMALL_DECODE)
#   bash benchmarks/h200_session.sh s53        # the files unrun on a GPU since the packed
#                                                decode form, D = 256 pages; A/Bs of
#                                                PAGED_D256, SMALL_DECODE(_WIDE)
#   bash benchmarks/h200_session.sh fused-why  # session 46: where the fused merge's cost at
#                                                32 splits goes (prof_fused_merge.py: each
#                                                kernel's time in both forms, then ncu)
#   bash benchmarks/h200_session.sh exp fwd|bwd [bench]  # experiments reverted in main,
#                                                re-applied (before_after.sh prep-revert
#                                                REV...): their GPU tests; with bench, their
#                                                tables against this tree in turns
#   bash benchmarks/h200_session.sh prof-bwd [D]  # Nsight Compute: the backward's kernels
#                                                beside cuDNN's (benchmarks/ncu_bwd.py), S = 1k
#                                                and 4k, D = 128 or D
#   Before / after tables of two trees in one call: benchmarks/before_after.sh. The one-off
#   modes of earlier sessions (their checks recorded in NOTES.md / RESULTS.md) are in the
#   git history of this file.
#   (issue 20's figures: benchmarks/h200_fuzz_memcheck.sh, fuzz beside memcheck)
# Note: `-m gpu` alone selects only the real-size tests; the parametrized kernel tests
# (the same ones CI runs under the interpreter) run on CUDA too when no marker is given.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# An unknown mode is refused: it would otherwise run the whole default session. The modes
# are read from this file's own tests of $1 (a list written out by hand missed one).
MODES=" $(grep -o '"$1" = [a-z0-9-]*' "$0" | awk '{print $3}' | tr '\n' ' ') "
if [ -n "${1:-}" ] && [[ "$MODES" != *" $1 "* ]]; then
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
bwd_tests() {
    # bwd_tests NAME SELECTION: tests/kernels/test_bwd.py -k SELECTION (stops at the first
    # failure), its log in $OUT/test_NAME.log; prints the summary and the failures.
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_bwd.py -k "$2" \
        > "$OUT/test_$1.log" 2>&1
    echo "tests: $(tail -1 "$OUT/test_$1.log")"
    grep -h "^FAILED\|^E " "$OUT/test_$1.log" | head
}
in_turn() {
    # in_turn PASSES COMMAND...: COMMAND with .before's package (before_after.sh prep REV) and
    # with this tree's, in turn, PASSES times; each output line led by "<tree> <pass> ".
    local passes=$1 pass tree root; shift
    [ -d .before ] || { echo "(no .before: nothing to compare)"; return 0; }
    for pass in $(seq 1 "$passes"); do
        for tree in before after; do
            root=$PWD; [ $tree = before ] && root=$PWD/.before
            PYTHONPATH=$root "$@" 2>&1 | sed "s/^/$tree $pass /"
        done
    done
}
if [ "$1" = host22 ]; then
    # Session 22: the backward's host descriptors handed to Triton's C launcher directly
    # (_common.DescLaunch): its GPU tests and session 21's, the host profile of every public
    # call, host us a fwd+bwd before (.before, carried) / after alternating, then
    # bench_varlen --model at two draws.
    bwd_tests host22 "(test_attn_bwd_gpu_sm90[ and bf16 and not tl) or host_descriptors or gpu_varlen"
    timeout 120 python3 benchmarks/profile_host.py --top 45 > "$OUT/prof_all.txt" 2>&1
    grep "===" "$OUT/prof_all.txt"
    for pass in 1 2; do
        for tree in before after; do
            root=$PWD; [ $tree = before ] && root=$PWD/.before
            PYTHONPATH=$root timeout 60 python3 $root/benchmarks/profile_host.py --rows "fwd+bwd" \
                --top 0 2>&1 | grep "===" | sed "s/^/$tree $pass /"
        done
    done
    for seed in 0 3; do
        timeout 90 python3 benchmarks/bench_varlen.py --seed $seed --model 2>&1 \
            | grep -E "attention|ratio|model" | cut -c1-120
    done
    exit 0
fi
if [ "$1" = topk ]; then
    # Issue 18's top-k decode (decode_mla_sm90's token tables; TOPK_SPLIT): the top-k, sparse
    # and sync-free GPU tests, bench_mla's top-k rows (public call and graph; B = 64 was
    # host-bound in session 23), bench_sparse's MLA prefill, then host us of the top-k call,
    # .before's package (before_after.sh prep REV) and this one in turn.
    K=tests/kernels
    timeout 150 python3 -m pytest -q -p no:cacheprovider $K/test_decode_mla_sm90.py \
        $K/test_sparse_kernels.py $K/test_sync_free.py $K/test_launch_fast_path.py \
        -k "topk or sparse or serving" \
        > "$OUT/test_topk.log" 2>&1; echo "tests: $(tail -1 "$OUT/test_topk.log")"
    grep -h "^FAILED" "$OUT/test_topk.log" | head
    timeout 100 python3 benchmarks/bench_mla.py --topk-only --gluon-only --out "$OUT" \
        > "$OUT/mla_topk.log" 2>&1; grep "^top-k\|^B=" "$OUT/mla_topk.log"
    timeout 60 python3 benchmarks/bench_sparse.py 2>&1 | grep -i "mla" | head -2
    in_turn 3 timeout 60 python3 benchmarks/profile_host.py --rows sparse --top 0 | grep "==="
    exit 0
fi
if [ "$1" = kept ]; then
    # Session 24: a repeated decode call launches the plan kept by its key (ops/kvcache._KEPT;
    # merge_states: ops/merge._KEPT):
    # the kernel tests of that path, the sync-free and fast-path tests, then host us of
    # bench_overhead's kvcache and merge rows, .before's package and this one in turn.
    K=tests/kernels
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider $K/test_kvcache_kernels.py \
        $K/test_sync_free.py $K/test_launch_fast_path.py $K/test_cuda_graphs.py \
        $K/test_combine.py $K/test_fwd.py -k "kept or kvcache or serving or decode or merge" \
        > "$OUT/test_kept.log" 2>&1
    echo "tests: $(tail -1 "$OUT/test_kept.log")"; grep -h "^FAILED" "$OUT/test_kept.log" | head
    in_turn 2 timeout 100 python3 benchmarks/bench_overhead.py --functions kvcache,merge,fwd \
        --out /tmp/kept | grep -E " (attention_with_kvcache|merge_states|attention fwd) "
    exit 0
fi
if [ "$1" = raw ]; then
    # Session 25: raw launches for kernels with global scratch (every Gluon kernel): the
    # Gluon kernels' GPU tests in two shards, then host us of the public calls with
    # _common.RAW_LAUNCH on / off in turns (session 24's A/B had it for scratch-free kernels).
    K=tests/kernels
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider $K/test_fwd.py $K/test_launch_fast_path.py \
        $K/test_cuda_graphs.py $K/test_sync_free.py -k "(sm90 and bf16) or fast or graph or sync or kept" \
        > "$OUT/test_raw_a.log" 2>&1 &
    P1=$!
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider $K/test_decode_mla_sm90.py $K/test_bwd.py \
        $K/test_fwd_paged_sm90.py -k "mla or (sm90 and bf16 and not tl) or (paged and bf16)" \
        > "$OUT/test_raw_b.log" 2>&1 &
    P2=$!
    wait $P1 $P2
    for f in "$OUT"/test_raw_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_raw_*.log | head
    timeout 170 python3 benchmarks/profile_host.py --ab _common.RAW_LAUNCH --rounds 4 2>&1 \
        | tee "$OUT/ab_raw.log" | tail -12
    exit 0
fi
if [ "$1" = sized ]; then
    # Session 25 (not GPU-run there): the paged forward's plans no longer key on the lengths
    # (fwd._paged_launch, fwd_sm90._PagedRun, _common.SizedLaunch: total_q, max_seqlen_q / k,
    # the batch and the grid passed each call; ops/attention._PAGED_KEPT). Its GPU tests
    # (serving steps sharing one plan, paged varlen, chunked prefill), then host us of steps
    # whose max_seqlen_k moves every call, against .before (before_after.sh prep REV) in
    # turns, then bench_serving (GPU time, unchanged expected). Under 10 minutes.
    K=tests/kernels
    # The new serving-step tests first (a long list may be cut by its limit).
    timeout 100 python3 -m pytest -q -p no:cacheprovider $K/test_fwd_paged_sm90.py \
        $K/test_kvcache_kernels.py -k "serving or share_one_plan" > "$OUT/test_sized_0.log" 2>&1
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider $K/test_fwd_paged_sm90.py \
        -k "bf16 or failure or bad_page or nan or sink" > "$OUT/test_sized_a.log" 2>&1 &
    P1=$!
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider $K/test_kvcache_kernels.py \
        $K/test_sync_free.py $K/test_launch_fast_path.py $K/test_cuda_graphs.py \
        -k "paged or prefill or varlen or graph or fast" > "$OUT/test_sized_b.log" 2>&1 &
    P2=$!
    wait $P1 $P2
    for f in "$OUT"/test_sized_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_sized_*.log | head
    in_turn 2 timeout 60 python3 benchmarks/bench_overhead.py --functions paged \
        --out /tmp/sized | grep -E " varlen paged step "
    timeout 120 python3 benchmarks/bench_serving.py 2>&1 | tail -8
    exit 0
fi
if [ "$1" = keep-ab ]; then
    # The public calls' kept plans (session 24-25: kvcache, merge, attention's inference
    # forward, the paged call's checks, sparse's decode plan) on / off in one process, in
    # turns (_validate.KEEP_PLANS): their host us on the GPU, which session 25's call 1
    # could not give (its in-turn A/B ran one tree twice).
    timeout 200 python3 benchmarks/profile_host.py --ab flashlse.ops._validate.KEEP_PLANS \
        --rounds 6 2>&1 | tee "$OUT/ab_keep.log" | grep "=== ab"
    exit 0
fi
if [ "$1" = readme ]; then
    # README's speed table from one run (issue 15's "rebuilt from public calls, with a
    # host-us column"): the forward and backward at D = 128 with FA-2 / cuDNN, decode and
    # merge against cuDNN / device copy, and bench_overhead's host us a call. Under 9 min.
    timeout 150 python3 benchmarks/bench_fwd.py --full --dims 128 --flex-budget 0 --out /tmp/fwd \
        > "$OUT/readme_fwd.txt" 2>&1; tail -14 "$OUT/readme_fwd.txt"
    timeout 150 python3 benchmarks/bench_bwd.py --quick --flex-budget 0 --out /tmp/bwd \
        > "$OUT/readme_bwd.txt" 2>&1; tail -14 "$OUT/readme_bwd.txt"
    timeout 80 python3 benchmarks/bench_decode.py --quick --out /tmp/dec > "$OUT/readme_decode.txt" \
        2>&1; tail -8 "$OUT/readme_decode.txt"
    timeout 50 python3 benchmarks/bench_merge.py --out /tmp/merge > "$OUT/readme_merge.txt" 2>&1
    tail -7 "$OUT/readme_merge.txt"
    timeout 110 python3 benchmarks/bench_overhead.py --out /tmp/oh > "$OUT/readme_overhead.txt" 2>&1
    grep "|" "$OUT/readme_overhead.txt" | tail -24
    exit 0
fi
if [ "$1" = readme2 ]; then
    # The README's rows the first call leaves out: the forward and backward at D = 64 and
    # 256 with FA-2 / cuDNN, and decode at every batch (B = 64 / 128 too, MLA, FlexAttention).
    timeout 200 python3 benchmarks/bench_fwd.py --full --dims 64,256 --flex-budget 0 \
        --out /tmp/fwd2 > "$OUT/readme2_fwd.txt" 2>&1; tail -22 "$OUT/readme2_fwd.txt"
    timeout 180 python3 benchmarks/bench_bwd.py --dims 64,256 --flex-budget 0 --out /tmp/bwd2 \
        > "$OUT/readme2_bwd.txt" 2>&1; tail -24 "$OUT/readme2_bwd.txt"
    timeout 180 python3 benchmarks/bench_decode.py --out /tmp/dec2 > "$OUT/readme2_decode.txt" \
        2>&1; tail -14 "$OUT/readme2_decode.txt"
    exit 0
fi
if [ "$1" = rebuild ]; then
    # Issue 18: the MLA decode's key-buffer descriptors rebuilt in the loop
    # (decode_mla_sm90.REBUILD_DESCRIPTORS, no spills in warpgroup 0's loop), in-process
    # through the public calls (ab_mla_switch.py: same bits on both sides), then the MLA
    # GPU tests.
    F=${2:-REBUILD_DESCRIPTORS}
    timeout 200 python3 benchmarks/ab_mla_switch.py --flag decode_mla_sm90.$F \
        > "$OUT/ab_$F.txt" 2>&1; tail -12 "$OUT/ab_$F.txt"
    # The whole file: 23 tests, 86-123 s on the H200 (session 28).
    timeout 200 python3 -m pytest -q tests/kernels/test_decode_mla_sm90.py -p no:cacheprovider \
        > "$OUT/test_rebuild.log" 2>&1
    tail -1 "$OUT/test_rebuild.log"; grep -h "^FAILED\|^ERROR" "$OUT/test_rebuild.log" | head
    exit 0
fi
if [ "$1" = paged-persistent ]; then
    # Issue 16: the persistent varlen kernel over paged caches. The Hopper paged tests run
    # every case on both forms (persistent, grid); the serving paths that reach it; then the
    # chunked-prefill rows and the mixed step with the flag on and off in turn.
    # (108 cases, ~3 s each on the H200: PAGED_FROM skips the first ones of the collection.)
    python3 -m pytest --collect-only -q tests/kernels/test_fwd_paged_sm90.py 2>/dev/null \
        | grep "::" | tail -n +"${PAGED_FROM:-1}" > "$OUT/paged_ids.txt"
    timeout "${PAGED_S:-400}" python3 -m pytest -q $(cat "$OUT/paged_ids.txt") \
        -p no:cacheprovider > "$OUT/test_paged.log" 2>&1
    echo "paged tests from ${PAGED_FROM:-1}: $(tail -1 "$OUT/test_paged.log")"
    grep -h "^FAILED\|^ERROR" "$OUT/test_paged.log" | head -12
    timeout "${SERVING_S:-150}" python3 -m pytest -q tests/kernels/test_kvcache_kernels.py \
        tests/kernels/test_sync_free.py tests/kernels/test_cuda_graphs.py \
        -k "paged or prefill or varlen or serving" -p no:cacheprovider \
        > "$OUT/test_serving.log" 2>&1
    echo "serving tests: $(tail -1 "$OUT/test_serving.log")"
    grep -h "^FAILED\|^ERROR" "$OUT/test_serving.log" | head -8
    [ -n "${NO_BENCH:-}" ] && exit 0
    timeout 180 python3 benchmarks/bench_serving.py --flag fwd_sm90.PAGED_PERSISTENT \
        > "$OUT/serving_ab.txt" 2>&1; tail -14 "$OUT/serving_ab.txt"
    exit 0
fi
if [ "$1" = split-kv ]; then
    # NOTES session 30: key splits for paged calls of few row blocks x heads. The paged GPU
    # tests' "split" form (two shards), a few of them under memcheck, then the A/B.
    P=tests/kernels/test_fwd_paged_sm90.py
    timeout 240 python3 -m pytest -q $P -k "split and matches_reference" -p no:cacheprovider \
        > "$OUT/test_split_a.log" 2>&1 &
    timeout 240 python3 -m pytest -q $P -k "split and not matches_reference" \
        -p no:cacheprovider > "$OUT/test_split_b.log" 2>&1 &
    # (session 30's kept dealing on every persistent case: NaN keys, sink edges)
    timeout 240 python3 -m pytest -q $P -k "persistent" -p no:cacheprovider \
        > "$OUT/test_split_p.log" 2>&1 &
    wait
    timeout 120 python3 -m pytest -q tests/kernels/test_fwd.py -k "key_splits or merge_splits" \
        -p no:cacheprovider > "$OUT/test_split_c.log" 2>&1
    for f in "$OUT"/test_split_*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_split_*.log | head
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q $P \
        -k "split and (bad_page or kvcache_prefill)" -p no:cacheprovider \
        > "$OUT/memcheck_split.log" 2>&1; echo "memcheck rc=$?: $(tail -1 "$OUT/memcheck_split.log")"
    for args in "--shape 1,512,65536 --heads 8,2" "--shape 1,2048,65536 --heads 8,2" \
                "--shape 1,512,65536" "--shape 4,512,8192 --heads 8,2"; do
        timeout 100 python3 benchmarks/bench_serving.py --flag fwd_sm90.PAGED_SPLIT_KV $args \
            2>&1 | grep "serving prefill\|paged [0-9]* (" | cut -c1-120
    done
    # The contiguous cache's rows (packed varlen form, VARLEN_SPLIT_KV).
    timeout 100 python3 benchmarks/bench_serving.py --flag fwd_sm90.VARLEN_SPLIT_KV \
        --shape 1,512,65536 --heads 8,2 2>&1 | grep "contiguous" | cut -c1-120
    exit 0
fi
if [ "$1" = fused64 ]; then
    # Session 36: D = 64's fused backward (bwd_sm90.FUSED_D64: the dK/dV kernel's warpgroups
    # take dQ's tiles in turn): its GPU tests (and every D = 64 backward test now on it),
    # then fwd+bwd with the flag on / off in turn, MHA (32 heads) and GQA 32 / 8.
    timeout 300 python3 -m pytest -q tests/kernels/test_bwd.py -k "64 and (fused or \
        direct_launch or sm90_varlen or bad_data or lpt_order or head_dims or other_dims)" \
        -p no:cacheprovider > "$OUT/test_fused64.log" 2>&1
    tail -1 "$OUT/test_fused64.log"; grep -h "^FAILED\|^ERROR" "$OUT/test_fused64.log" | head
    for kv in 32 8; do
        timeout 130 python3 benchmarks/ab_bwd_switch.py --flag bwd_sm90.FUSED_D64 --dim 64 \
            --heads 32 --kv-heads $kv --seqs 1024,2048,4096,8192 2>&1 | tail -9
    done
    exit 0
fi
if [ "$1" = paged-next ]; then
    # The chunked-prefill rows at the bar's shape and at a long context (32 heads, and 8 as
    # one GPU of a TP = 4 model holds: fewer items than SMs), the paged steps' host time.
    timeout 150 python3 benchmarks/bench_serving.py --flag fwd_sm90.PAGED_PERSISTENT \
        > "$OUT/serving_8k.txt" 2>&1; tail -12 "$OUT/serving_8k.txt"
    timeout 150 python3 benchmarks/bench_serving.py --shape 1,512,65536 \
        > "$OUT/serving_64k.txt" 2>&1; grep -h "paged\|dense" "$OUT/serving_64k.txt" | head -8
    # One GPU of a TP = 4 model (8 / 2 heads): 4 row blocks x 8 heads = 32 items, 132 SMs.
    for sq in 512 2048; do
        timeout 100 python3 benchmarks/bench_serving.py --shape 1,$sq,65536 --heads 8,2 \
            >> "$OUT/serving_64k.txt" 2>&1
    done; grep -h "serving prefill\|paged [0-9]* (\|dense kernel" "$OUT/serving_64k.txt" | tail -8
    timeout 150 python3 benchmarks/bench_overhead.py --functions paged,kvcache --out "$OUT" \
        > "$OUT/overhead_paged.txt" 2>&1; tail -12 "$OUT/overhead_paged.txt"
    exit 0
fi
if [ "$1" = mla-why ]; then
    # Issue 18's B = 128 Skv = 4k: where a program's fixed ~19 us and the second wave's
    # slower tile come from (NOTES, session 26's next steps): mla_fixed_cost.py with its
    # program-count sweep, then Nsight Compute over one and two waves (benchmarks/ncu_mla.py:
    # DRAM throughput and L2 hit rate per launch).
    timeout 240 python3 benchmarks/mla_fixed_cost.py 2>&1 | tee "$OUT/mla_fixed_cost.log"
    timeout 200 ncu --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --csv --page details python3 benchmarks/ncu_mla.py \
        --run > "$OUT/ncu_mla.csv" 2> "$OUT/ncu_mla.err"
    echo "ncu rc=$?"
    python3 benchmarks/ncu_bwd.py --read "$OUT/ncu_mla.csv" | cut -c1-150
    exit 0
fi
if [ "$1" = mla-cost ]; then
    # Issue 18's dense B = 128 Skv = 4k row: a program's fixed cost measured (one wave of
    # programs, 1 to 128 tiles; benchmarks/mla_fixed_cost.py), then the MLA public rows
    # with host us (dense MLA and top-k, B = 64 / 128).
    timeout 200 python3 benchmarks/mla_fixed_cost.py 2>&1 | tee "$OUT/mla_fixed_cost.log"
    timeout 150 python3 benchmarks/bench_overhead.py --functions mla,topk --out "$OUT" \
        2>&1 | grep -E "^(MLA decode|sparse MLA top-k) "
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
if [ "$1" = prof-bwd ]; then
    # Issue 22's backward gap, kernel by kernel against cuDNN's (one public fwd+bwd and one
    # cuDNN SDPA fwd+bwd each, causal at S = 1k and 4k, B*S = 16k, H*D = 2048, D = ${2:-128}).
    for s in 1024 4096; do
        timeout 240 ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
            --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
            --csv --page details python3 benchmarks/ncu_bwd.py --run --seqlen $s \
            --dim "${2:-128}" > "$OUT/ncu_bwd_$s.csv" 2> "$OUT/ncu_bwd_$s.err"
        echo "== causal S=$s (rc $?)"
        python3 benchmarks/ncu_bwd.py --read "$OUT/ncu_bwd_$s.csv" | cut -c1-140
    done
    exit 0
fi
if [ "$1" = prof-fwd64 ]; then
    # Issue 22's D = 64 forward gap (causal 1k 0.77x cuDNN): one public forward and one
    # cuDNN SDPA forward (B*S = 16k, H = 32), causal 1k and full 4k: instruction and
    # cycle counts, each pipe's utilisation and the warps' stall reasons (ncu raw page).
    for cfg in "1024" "4096 --full"; do
        set -- $cfg
        timeout 200 ncu --profile-from-start off --section ComputeWorkloadAnalysis \
            --section WarpStateStats --section SpeedOfLight --csv --page raw --metrics \
            smsp__inst_executed.sum,smsp__inst_executed_pipe_xu.sum,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__cycles_elapsed.max \
            python3 benchmarks/ncu_bwd.py --run --forward --dim 64 --seqlen $cfg \
            > "$OUT/ncu_fwd64_$1$2.csv" 2> "$OUT/ncu_fwd64_$1$2.err"
        echo "== D=64 S=$1 $2 (rc $?)"
        python3 benchmarks/ncu_bwd.py --pipes "$OUT/ncu_fwd64_$1$2.csv" | cut -c1-150
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
if [ "$1" = s44 ]; then
    # Session 43 kept the experiment d7f8ae2's register-lean consumer loops for D <= 128; the
    # experiment's own GPU tests ran out of time at 152 forward and 129 paged cases (none
    # failed). "s44 tests": every Hopper forward case and the paged file on the kept form,
    # and the window sides near 2^31 (test_window_bounds.py) on every GPU kernel path.
    # "s44 bench": its table against the tree before it (.before from `before_after.sh prep
    # 0b71d64`), then the paged steps' host time
    # and the attention rows' host time beside SDPA cuDNN's (bench_overhead's peer rows).
    if [ "$2" = d256 ]; then
        # Which half of the lean form cost D = 256 its 1-3.5% (session 43): each alone at
        # D = 256, in turns with this tree's plain D = 256 form (bench_fwd --full --dims 256).
        for half in ${3:-ROW_BOUNDS EARLY_P}; do  # ("s44 d256 EARLY_P": that half alone)
            rm -rf ".exp_$half" && mkdir ".exp_$half" && cp -r flashlse benchmarks ".exp_$half/"
            sed -i "s/^${half}_MAX_D = gl.constexpr(128)/${half}_MAX_D = gl.constexpr(256)/" \
                ".exp_$half/flashlse/kernels/fwd_sm90.py"
            grep -q "^${half}_MAX_D = gl.constexpr(256)" ".exp_$half/flashlse/kernels/fwd_sm90.py" \
                || { echo "s44 d256: no ${half}_MAX_D to patch"; exit 2; }
            echo "$half at D = 256" > ".exp_$half/REV"
            BEFORE=".exp_$half" FWD_ARGS="--dims 256" PASSES=2 timeout 280 \
                bash benchmarks/before_after.sh run fwd
        done
        exit 0
    fi
    if [ "$2" = bench ]; then
        [ -d .before ] || { echo "s44 bench: no .before (before_after.sh prep 0b71d64)"; exit 2; }
        PASSES=2 timeout 420 bash benchmarks/before_after.sh run fwd
        timeout 150 python3 benchmarks/bench_overhead.py --functions paged --out "$OUT/paged" \
            2>&1 | tail -5
        # Issue 15's training-step host bar beside its peer: SDPA cuDNN's fwd / fwd+bwd.
        timeout 150 python3 benchmarks/bench_overhead.py --out "$OUT/peers" \
            --functions fwd,sdpa_fwd,fwdbwd,sdpa_fwdbwd 2>&1 | tail -11
        exit 0
    fi
    timeout 560 python3 -m pytest -q $K/test_fwd.py -k "sm90 and not fp16 and persistent" \
        -p no:cacheprovider > "$OUT/test_gpu_fwd_persistent.log" 2>&1 &
    (timeout 120 python3 -m pytest -q $K/test_window_bounds.py $K/test_kvcache_kernels.py \
        -k "huge_window or int32_max or above_the_rows or forced_splits or 65535 or sliced_from" \
        -p no:cacheprovider > "$OUT/test_gpu_window.log" 2>&1
     # Session 44: the host-int LSE contract, the SDPA launchers (checked inputs, routed),
     # the transformers backend against real eager (its tests compared flashlse with itself
     # before), and no second derivative on the kernels.
     timeout 100 python3 -m pytest -q $K/test_host_int_contract.py $K/test_sdpa_impl.py \
        $K/test_integrations_gpu.py $K/test_second_derivative_kernels.py \
        -p no:cacheprovider > "$OUT/test_gpu_contract.log" 2>&1
     timeout 330 python3 -m pytest -q $K/test_fwd.py -k "sm90 and not fp16 and not persistent" \
        -p no:cacheprovider > "$OUT/test_gpu_fwd_other.log" 2>&1) &
    timeout 560 python3 -m pytest -q $K/test_fwd_paged_sm90.py -p no:cacheprovider \
        > "$OUT/test_gpu_paged.log" 2>&1 &
    # Session 45: the decode merge fused into the split kernel (decode.FUSED_MERGE): its
    # GPU tests (memory ordering over many calls, two streams, graph capture) and the
    # decode / kvcache / graph files on the fused form.
    timeout 300 python3 -m pytest -q $K/test_decode_fused_merge.py $K/test_decode.py \
        $K/test_cuda_graphs.py $K/test_sync_free.py -p no:cacheprovider \
        > "$OUT/test_gpu_fused_merge.log" 2>&1 &
    wait
    for f in "$OUT"/test_gpu_*.log; do
        echo "$f: $(grep -E 'passed|failed|error' "$f" | tail -1) ($(tr -cd . < "$f" | wc -c) dots)"
    done
    grep -h "^FAILED" "$OUT"/test_gpu_*.log | head -10
    exit 0
fi
if [ "$1" = fused ]; then
    # Session 45: the split-KV merge fused into the decode's split kernel (decode.FUSED_MERGE,
    # on since session 46 up to FUSED_MERGE_MAX_SPLITS splits): its GPU tests (memory
    # ordering over 300 calls and two streams, graph capture), the decode files with it at
    # every split count, then host us (profile_host --ab) and the public calls' device time
    # (ab_decode_switch) on / off in turns.
    run_tests fused $K/test_decode_fused_merge.py
    FLASHLSE_TEST_FUSED_MERGE=1 run_tests fused_decode $K/test_decode.py $K/test_cuda_graphs.py \
        $K/test_sync_free.py $K/test_kvcache_kernels.py -k "decode or kvcache or split"
    for f in "$OUT"/test_gpu_fused*.log; do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_gpu_fused*.log | head -10
    timeout 150 python3 benchmarks/profile_host.py --ab decode.FUSED_MERGE --rows kvcache \
        --rounds 6 2>&1 | grep "^=== ab"
    timeout 200 python3 benchmarks/ab_decode_switch.py --flag decode.FUSED_MERGE 2>&1 | tail -10
    # Session 46: the mixed paged step's host time (133 us over its floor in session 42, 27 us
    # CPU-stubbed: the gap is in the Hopper paged plan's per-call Python), by cProfile.
    timeout 90 python3 benchmarks/profile_host.py --rows "mixed" --top 30 --sort cumulative \
        > "$OUT/profile_mixed.txt" 2>&1; grep -m3 -E "us a call|===" "$OUT/profile_mixed.txt"
    exit 0
fi
s47_tests() {  # sessions 46-47's GPU tests, three processes at once
    run_tests unread $K/test_decode_fused_merge.py $K/test_sync_free.py $K/test_cuda_graphs.py &
    FLASHLSE_TEST_FUSED_MERGE=1 run_tests sparse_fused $K/test_sparse_kernels.py &
    run_tests short $K/test_short_query.py $K/test_fwd.py $K/test_bwd.py $K/test_nan_kernels.py \
        $K/test_launch_plans.py $K/test_kvcache_leftpad_kernels.py \
        -k "short or decode_row or sq1 or sq_gt or launch_plan or leftpad" &
    wait
    for f in "$OUT"/test_gpu_unread.log "$OUT"/test_gpu_sparse_fused.log "$OUT"/test_gpu_short.log
    do echo "$f: $(tail -1 "$f")"; done
    grep -h "^FAILED" "$OUT"/test_gpu_*.log | head -8
}
if [ "$1" = s47 ]; then
    # Sessions 46-47, never run on a GPU yet: the unread lse on kept scratch (on in main) and
    # the token table's fused merge (decode.FUSED_MERGE_TOKEN_TABLE, off): their GPU tests,
    # then the token table's A/B (public sparse_attention, device ms and host us in turns;
    # turn it on at level device time, as the dense form), then the kvcache rows' host us
    # (against the session-46 rows: 38.6 / 47.1 / 34.1 / 32.6 / 37.8 on an H100).
    # Session 47 also: dense calls of <= 16 query rows on the decode kernel
    # (dispatch.SHORT_Q_DECODE, on): their tests and the dense files' short rows, then the
    # A/B (public fl.attention, cuDNN beside the one-row rows); cache_leftpad's kernel tests.
    # "s47": the tests (three processes at once); "s47 bench": the A/Bs and host rows;
    # "s47 bench tf": bench_transformers (each under the 10-minute call).
    if [ "$2" != bench ]; then s47_tests; exit 0; fi
    if [ "$3" = tf ]; then
        # transformers end to end (generate B = 1 and 8 left-padded, a training step) against
        # its own "sdpa" implementation.
        timeout 300 python3 benchmarks/bench_transformers.py 2>&1 | tee "$OUT/tf.txt" | tail -8
        exit 0
    fi
    AB_SET=short timeout 220 python3 benchmarks/ab_decode_switch.py \
        --flag dispatch.SHORT_Q_DECODE 2>&1 | tee "$OUT/ab_short.txt" | tail -11
    AB_SET=sparse timeout 150 python3 benchmarks/ab_decode_switch.py \
        --flag decode.FUSED_MERGE_TOKEN_TABLE 2>&1 | tee "$OUT/ab_sparse.txt" | tail -6
    timeout 110 python3 benchmarks/bench_overhead.py --functions kvcache --out "$OUT/kv" \
        2>&1 | grep "^attention_with" | grep "|"
    exit 0
fi
if [ "$1" = s48 ]; then
    # Session 48 had little device time (failed starts): s47's tests (300 s each) and the
    # short-query A/B in one call (< 10 min); its leftovers are "s49".
    run_tests() { local name=$1; shift
        timeout 300 python3 -m pytest -q "$@" -p no:cacheprovider > "$OUT/test_gpu_$name.log" 2>&1; }
    s47_tests
    AB_SET=short timeout 220 python3 benchmarks/ab_decode_switch.py \
        --flag dispatch.SHORT_Q_DECODE 2>&1 | tee "$OUT/ab_short.txt" | tail -11
    exit 0
fi
if [ "$1" = s49 ]; then
    # Session 48's leftovers in one call (< 9 min), for a session with little device time:
    # the tests its first call failed, after their fixes (61), the split floor's A/B on the
    # B = 1 short-query rows (decode.SPLIT_FLOOR: on where every row is >= 1.0), the route
    # past 16 rows (dispatch.SHORT_Q_WIDE, AB_SET=wide: where its bound belongs), the token
    # table's fused-merge A/B (decode.FUSED_MERGE_TOKEN_TABLE: on where device time is level;
    # its GPU tests passed in session 48). "s49 tf": bench_transformers.
    timeout 170 python3 -m pytest -q -p no:cacheprovider $K/test_kvcache_leftpad_kernels.py \
        $K/test_fwd.py $K/test_bwd.py $K/test_short_query.py \
        -k "leftpad or (fwd_gpu_sm90 and decode_row) or (sm90_other_dims and (decode_row or sq_gt)) or override or wide" \
        > "$OUT/test_gpu_fix.log" 2>&1
    tail -1 "$OUT/test_gpu_fix.log"; grep "^FAILED" "$OUT/test_gpu_fix.log" | head -8
    if [ "$2" = tf ]; then
        timeout 400 python3 benchmarks/bench_transformers.py 2>&1 | tee "$OUT/tf.txt" | tail -8
        exit 0
    fi
    AB_SET=short AB_ROWS="attention B=1 Sq=1 Skv=4k;attention B=1 Sq=1 Skv=32k;attention B=1 Sq=4 Skv=8k" \
        timeout 90 python3 benchmarks/ab_decode_switch.py --flag decode.SPLIT_FLOOR 2>&1 \
        | tee "$OUT/ab_floor.txt" | tail -5
    AB_ROWS="B=1 Skv=4k;B=1 Skv=128k;B=8 Skv=4k" timeout 90 python3 \
        benchmarks/ab_decode_switch.py --flag decode.SPLIT_FLOOR 2>&1 \
        | tee "$OUT/ab_floor_kv.txt" | tail -5
    AB_SET=wide timeout 110 python3 benchmarks/ab_decode_switch.py \
        --flag dispatch.SHORT_Q_WIDE 2>&1 | tee "$OUT/ab_wide.txt" | tail -7
    AB_SET=sparse timeout 90 python3 benchmarks/ab_decode_switch.py \
        --flag decode.FUSED_MERGE_TOKEN_TABLE 2>&1 | tee "$OUT/ab_sparse.txt" | tail -6
    exit 0
fi
if [ "$1" = s51 ]; then
    # Session 51 (< 9 min). Call 1 (b5fbc69) ran session 50's review fixes, the paged
    # 2-16-row kvcache A/B (the decode kernel won: kept), a growing miss's cProfile and the
    # transformers table. Now: paged attention_varlen calls of uniform <= 16-row sequences
    # on the decode kernel (dispatch.PAGED_DECODE; lse in the varlen layout by the plan's
    # strides): its tests, the decode / paged / NaN / sync-free / graph / compile files, the
    # A/B through the public call (predicted >= 3x at B = 1 32k, level or better at B = 64),
    # host us on / off of the paged decode step; with "d256", then session 43's D = 256 halves.
    timeout 100 python3 -m pytest -q -p no:cacheprovider $K/test_varlen_paged_decode.py \
        $K/test_nan_kernels.py $K/test_sync_free.py $K/test_cuda_graphs.py \
        $K/test_decode_mla_sm90.py > "$OUT/test_gpu_s51.log" 2>&1
    tail -1 "$OUT/test_gpu_s51.log"; grep "^FAILED" "$OUT/test_gpu_s51.log" | head -8
    AB_SET=varlenpaged timeout 100 python3 benchmarks/ab_decode_switch.py \
        --flag dispatch.PAGED_DECODE 2>&1 | tail -9
    PYTHONPATH=$PWD timeout 45 python3 benchmarks/profile_host.py --ab dispatch.PAGED_DECODE \
        --rows "paged decode step" --rounds 6 2>&1 | grep "^=== ab"
    # The mixed step at a long context with few decodes (their rows on the portable paged
    # kernel, no key split) against the separate calls: the gap the route cannot reach.
    timeout 90 python3 benchmarks/bench_serving.py --mixed 1,512,65024,2,65536 2>&1 | tail -2
    [ "$2" = d256 ] || exit 0
    exec bash "$0" s44 d256
fi
if [ "$1" = s52 ]; then
    # Session 52 (< 9 min): s51's route (dispatch.PAGED_DECODE: tests, A/B, host us) and a
    # mixed step's short sequences on the decode kernel's packed form (dispatch.SMALL_DECODE:
    # its tests; the mixed step on / off against the separate calls, predicted ~1.3x at one
    # chunk and two decodes on 64k keys, level at 128 decodes on 4k).
    timeout 150 python3 -m pytest -q -p no:cacheprovider $K/test_varlen_paged_decode.py \
        $K/test_varlen_paged_mixed.py $K/test_nan_kernels.py $K/test_sync_free.py \
        $K/test_cuda_graphs.py $K/test_decode_mla_sm90.py $K/test_decode_fused_merge.py \
        > "$OUT/test_gpu_s52.log" 2>&1
    tail -1 "$OUT/test_gpu_s52.log"; grep "^FAILED" "$OUT/test_gpu_s52.log" | head -8
    for m in 1,512,65024,2,65536 1,2048,30720,4,32768 4,2048,2048,128,4096; do
        timeout 60 python3 benchmarks/bench_serving.py --mixed $m --flag dispatch.SMALL_DECODE \
            2>&1 | tail -2
    done
    AB_SET=varlenpaged timeout 100 python3 benchmarks/ab_decode_switch.py \
        --flag dispatch.PAGED_DECODE 2>&1 | tail -9
    PYTHONPATH=$PWD timeout 45 python3 benchmarks/profile_host.py --ab dispatch.PAGED_DECODE \
        --rows "paged decode step" --rounds 6 2>&1 | grep "^=== ab"
    PYTHONPATH=$PWD timeout 45 python3 benchmarks/profile_host.py --ab dispatch.SMALL_DECODE \
        --rows "mixed" --rounds 6 2>&1 | grep "^=== ab"
    exit 0
fi
if [ "$1" = s53 ]; then
    # Session 53 (< 9.5 min). Tests, three processes: the files not run on a GPU since the
    # decode kernel's packed form (test_short_query.py; the mixed file's LSE-contract test
    # and SMALL_DECODE_WIDE's), and D = 256 over pages on the Gluon kernels
    # (fwd_sm90.PAGED_D256, off: its cases turn it on). Then A/Bs through the public calls:
    # PAGED_D256 (the mixed step at D = 256, 32 / 8 and 8 / 2 heads; predicted 1.2-1.5x and
    # 2-4x, as D = 64's flag gave), SMALL_DECODE_WIDE at G = 32 (predicted level or better
    # where the Hopper kernel splits the keys), SMALL_DECODE at 8 and 32 decodes on 64k.
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider --tb=line $K/test_short_query.py \
        > "$OUT/test_gpu_short.log" 2>&1 &
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider --tb=line \
        $K/test_varlen_paged_mixed.py $K/test_varlen_paged_decode.py \
        > "$OUT/test_gpu_mixed.log" 2>&1 &
    timeout ${S53_TESTS:-200} python3 -m pytest -q -p no:cacheprovider --tb=line $K/test_fwd_paged_sm90.py \
        -k d256 > "$OUT/test_gpu_paged256.log" 2>&1 &
    wait
    for f in "$OUT"/test_gpu_*.log; do echo "$f: $(grep -E 'passed|failed|error' "$f" | tail -1)"; done
    grep -h -E "^FAILED|^E |Error" "$OUT"/test_gpu_*.log | head -10
    for hm in "32,8 4,2048,2048,16,4096 fwd_sm90.PAGED_D256 256" \
              "8,2 1,2048,30720,4,32768 fwd_sm90.PAGED_D256 256" \
              "32,8 kv fwd_sm90.PAGED_D256 256" \
              "32,1 1,512,65024,4,65536 dispatch.SMALL_DECODE_WIDE" \
              "32,1 4,2048,2048,64,4096 dispatch.SMALL_DECODE_WIDE" \
              "32,8 1,512,65024,8,65536 dispatch.SMALL_DECODE" \
              "32,8 1,512,65024,32,65536 dispatch.SMALL_DECODE" \
              "64,2 1,512,65024,4,65536 dispatch.SMALL_DECODE_WIDE" \
              "8,1 1,512,65024,2,65536 dispatch.SMALL_DECODE"; do
        set -- $hm
        [ $SECONDS -lt ${S53_END:-430} ] || { echo "s53: no time for $hm"; continue; }
        if [ "$2" = kv ]; then  # attention_with_kvcache's chunks: pages in place or gathered
            timeout 90 python3 benchmarks/bench_serving.py --heads $1 --flag $3 --dim $4 2>&1 \
                | tail -18 | tee -a "$OUT/s53_ab.txt"
            continue
        fi
        timeout 60 python3 benchmarks/bench_serving.py --heads $1 --mixed $2 --flag $3 \
            --dim ${4:-128} 2>&1 | tail -2 | tee -a "$OUT/s53_ab.txt"
    done
    exit 0
fi
if [ "$1" = fused-why ]; then
    # Session 46: the fused decode merge costs +4.6-5.8 us at 32 splits (B = 1), nothing at 4,
    # whatever its step count; each kernel's device time in both forms, then ncu of both.
    timeout 200 python3 benchmarks/prof_fused_merge.py 2>&1 | tail -30
    timeout 200 ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section LaunchStats --section Occupancy --csv --page details \
        python3 benchmarks/prof_fused_merge.py --run --skv 4096 --splits 32 \
        > "$OUT/ncu_fused.csv" 2> "$OUT/ncu_fused.err"; echo "ncu rc=$?"
    python3 benchmarks/ncu_bwd.py --read "$OUT/ncu_fused.csv" 2>&1 | tail -40
    # The mixed paged step's Python by own time (session 46 had the cumulative top 30 only:
    # three launches, the Hopper paged plan's call, the kept key).
    timeout 90 python3 benchmarks/profile_host.py --rows "mixed" --top 60 --sort tottime \
        > "$OUT/profile_mixed_own.txt" 2>&1; head -40 "$OUT/profile_mixed_own.txt"
    exit 0
fi
if [ "$1" = exp ]; then
    # Experiments reverted in main, re-applied on today's code as .before (here:
    # `before_after.sh prep-revert 5f5fa58`, carry .before; since 973ad93 the revert of
    # 5f5fa58 conflicts in _consumer_persistent: keep the one _consumer_part call and pass it
    # OVERLAP3). Two calls, each < 10 min:
    # "exp fwd" runs the variant's Hopper forward tests, "exp fwd bench" its forward table
    # against this tree's in turns and D = 64's OVERLAP3 A/B; "exp bwd" / "exp bwd bench"
    # the backward's tests and table.
    [ -d .before ] || { echo "exp: no .before (before_after.sh prep-revert REV...)"; exit 2; }
    cat .before/REV
    B=$PWD/.before
    if [ "$3" = bench ]; then
        PASSES=2 timeout 560 bash benchmarks/before_after.sh run "${2:-fwd}"
        [ "$2" = bwd ] || PYTHONPATH=$B timeout 100 python3 $B/benchmarks/ab_fwd_configs.py \
            --dim 64 --variants '[{}, {"OVERLAP3": true}]' 2>&1 | tail -12
        exit 0
    fi
    # (From inside .before: `python -m` puts the working directory first on sys.path.)
    if [ "$2" = bwd ]; then
        (cd $B && PYTHONPATH=$B run_tests exp_bwd $K/test_bwd.py -k "sm90 and (bf16 or varlen)")
    else
        (cd $B && PYTHONPATH=$B run_tests exp_fwd $K/test_fwd.py -k "sm90 and not fp16") &
        (cd $B && PYTHONPATH=$B run_tests exp_paged $K/test_fwd_paged_sm90.py) &
        wait
    fi
    for f in "$OUT"/test_gpu_*.log; do echo "$f: $(grep -E 'passed|failed|error' "$f" | tail -1)"; done
    grep -h "^FAILED" "$OUT"/test_gpu_*.log | head -10
    exit 0
fi
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
