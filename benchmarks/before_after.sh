#!/usr/bin/env bash
# Benchmark tables of an earlier tree and of this one in the same device call (issue 21's
# "every table within +-2% of before, same run"). The earlier tree's package and benchmark
# scripts go into .before/ (git-ignored), which the device call carries:
#   bash benchmarks/before_after.sh prep 2dcb23b          # here: the tree before issue 21
#   bash benchmarks/before_after.sh run [fwd bwd decode merge serving]   # on the GPU, carry .before
#   bash benchmarks/before_after.sh variant-fwd   # .variant_fwd (D = 64 persistent) for h200_session.sh fwd-dims
#   bash benchmarks/before_after.sh variant-varlen   # .variant_varlen (the varlen forward's dynamic scheduler) for h200_session.sh varlen-dyn
#   bash benchmarks/before_after.sh variant-mla2     # .variant_mla2 (the MLA decode's two producer warps) for h200_session.sh mla-2p
# Each benchmark runs before, after, before, after (drift shows as a before/before spread);
# logs land in $OUT as <bench>_<tree><pass>.txt and the tables' last lines are printed.
set -o pipefail
if [ "$1" = variant-fwd ]; then
    # The variant for `h200_session.sh fwd-dims` (carry .variant_fwd): this tree with a Hopper
    # forward tile for D = 64 that takes the persistent kernel where it applies (session 15:
    # the grid kernel at D = 64 lost below 8k, where the per-block prologue weighs most).
    rm -rf .variant_fwd && mkdir .variant_fwd
    git archive HEAD flashlse benchmarks tools tests pyproject.toml | tar -x -C .variant_fwd
    python3 - <<'PY2'
p = ".variant_fwd/flashlse/kernels/configs.py"
s = open(p).read()
tile = ("    64: TileConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, pingpong=False,\n"
        "                   overlap=True, persistent=True, persistent_table=True,\n"
        "                   consumer_regs=240),\n")
s2 = s.replace("FWD_SM90 = {\n", "FWD_SM90 = {\n" + tile, 1)
assert s2 != s
open(p, "w").write(s2)
PY2
    exit $?
fi
if [ "$1" = variant-varlen ]; then
    # The variant for `h200_session.sh varlen-dyn` (carry .variant_varlen): this tree with the
    # persistent varlen forward's items dealt by an atomic counter (FA-3's dynamic scheduler:
    # the list's order dealt greedily) in 16 MB L2 sections
    # (benchmarks/variants/varlen_dynamic.patch; session 17: sections dealt statically trade
    # balance against L2 hits).
    rm -rf .variant_varlen && mkdir .variant_varlen
    git archive HEAD flashlse benchmarks tools tests pyproject.toml | tar -x -C .variant_varlen
    patch -s -p1 -d .variant_varlen < benchmarks/variants/varlen_dynamic.patch
    exit $?
fi
if [ "$1" = variant-mla2 ]; then
    # The variant for `h200_session.sh mla-2p` (carry .variant_mla2): this tree with the MLA
    # decode's pages below 32 rows loaded by two producer warps, a buffer each
    # (benchmarks/variants/mla_two_producers.patch; the paged forward's lesson, session 16).
    rm -rf .variant_mla2 && mkdir .variant_mla2
    git archive HEAD flashlse benchmarks tools tests pyproject.toml | tar -x -C .variant_mla2
    patch -s -p1 -d .variant_mla2 < benchmarks/variants/mla_two_producers.patch
    exit $?
fi
if [ "$1" = prep ]; then
    rm -rf .before && mkdir .before
    git archive "${2:?a revision}" flashlse benchmarks | tar -x -C .before
    echo "$2" > .before/REV
    exit 0
fi
[ "$1" = run ] || { echo "usage: $0 prep REV | run [fwd bwd decode merge serving]"; exit 2; }
shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
declare -A ARGS=([fwd]="--full --flex-budget 0 ${FWD_ARGS:-}" [bwd]="--quick --flex-budget 0" [decode]="--quick"
                 [merge]="" [serving]="")
for bench in ${@:-fwd bwd decode merge}; do
    for pass in $(seq 1 ${PASSES:-2}); do
        for tree in before after; do
            root=$PWD; [ $tree = before ] && root=$PWD/.before
            log="$OUT/${bench}_${tree}${pass}.txt"
            out="--out /tmp/ba_${tree}"; [ $bench = serving ] && out=
            PYTHONPATH=$root timeout 150 python3 "$root/benchmarks/bench_$bench.py" \
                ${ARGS[$bench]} $out > "$log" 2>&1
            echo "== $bench $tree $pass ($(cat .before/REV 2>/dev/null) / this tree)"
            tail -8 "$log"
        done
    done
done
