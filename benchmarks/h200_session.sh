#!/usr/bin/env bash
# One device call: GPU tests of the kernels at real sizes, the CUDA audit, the backward
# benchmark and the tiny-LM training comparison. Logs land in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
# The GPU tests compile many kernel variants: about 5 minutes in all on an H200.
timeout 330 python3 -m pytest -q -m gpu tests/kernels 2>&1 | tee "$OUT/test_gpu.log" | tail -6
timeout 50 python3 -m flashlse audit --device cuda > "$OUT/audit_cuda.txt" 2>&1; head -14 "$OUT/audit_cuda.txt"
timeout 120 python3 benchmarks/bench_bwd.py --quick --results --flex-budget 30 2>&1 | tee "$OUT/bench_bwd.txt" | tail -14
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
timeout 60 python3 examples/train_tiny_lm.py --steps 200 --out "$OUT/train.png" --json "$OUT/train.json" 2>&1 | tail -4
