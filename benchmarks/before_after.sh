#!/usr/bin/env bash
# Benchmark tables of an earlier tree and of this one in the same device call (issue 21's
# "every table within +-2% of before, same run"). The earlier tree's package and benchmark
# scripts go into .before/ (git-ignored), which the device call carries:
#   bash benchmarks/before_after.sh prep 2dcb23b          # here: the tree before issue 21
#   bash benchmarks/before_after.sh run [fwd bwd decode merge serving]   # on the GPU, carry .before
#   bash benchmarks/before_after.sh prep-revert 5f5fa58 [REV...]   # here: this tree (HEAD) with
#       those commits reverted, as .before: an experiment reverted in main is re-applied on
#       today's code (its tests come too: PYTHONPATH=.before pytest .before/tests/...)
# BEFORE=DIR runs another tree in .before's place (a variant made on the device itself).
# Each benchmark runs before, after, before, after (drift shows as a before/before spread);
# logs land in $OUT as <bench>_<tree><pass>.txt and the tables' last lines are printed.
set -o pipefail
if [ "$1" = prep ]; then
    rm -rf .before && mkdir .before
    git archive "${2:?a revision}" flashlse benchmarks | tar -x -C .before
    echo "$2" > .before/REV
    exit 0
fi
if [ "$1" = prep-revert ]; then
    shift
    wt=$(mktemp -d) && git worktree add -q --detach "$wt" HEAD || exit 1
    (cd "$wt" && git revert --no-commit "$@") || { git worktree remove --force "$wt"; exit 1; }
    rm -rf .before && mkdir .before
    cp -r "$wt"/flashlse "$wt"/benchmarks "$wt"/tests "$wt"/tools "$wt"/pyproject.toml .before/
    git worktree remove --force "$wt"
    echo "HEAD $(git rev-parse --short HEAD) with $* reverted" > .before/REV
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
            root=$PWD; [ $tree = before ] && root=$PWD/${BEFORE:-.before}
            log="$OUT/${bench}_${tree}${pass}.txt"
            out="--out /tmp/ba_${tree}"; [ $bench = serving ] && out=
            PYTHONPATH=$root timeout 150 python3 "$root/benchmarks/bench_$bench.py" \
                ${ARGS[$bench]} $out > "$log" 2>&1
            echo "== $bench $tree $pass ($(cat ${BEFORE:-.before}/REV 2>/dev/null) / this tree)"
            tail -8 "$log"
        done
    done
done
