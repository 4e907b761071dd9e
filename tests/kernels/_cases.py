"""Case tables the forward and backward kernel tests share (same shapes, same edge cases)."""

from __future__ import annotations

import pytest

# (seqlens_q, seqlens_k, keywords): packed batches with zero-length sequences, masks,
# seqused_k and a sink; tiles of 16 under the interpreter.
VARLEN_CASES = [
    pytest.param([5, 0, 33, 17], [9, 12, 0, 40], {}, id="zero_len_q_and_k"),
    pytest.param([20, 0, 7, 30], [9, 5, 20, 30], {"causal": True}, id="causal"),
    pytest.param([18, 25, 3], [30, 25, 40], {"used": [0, 20, 11], "sink": True},
                 id="seqused_k_sink"),
    pytest.param([18, 25], [30, 25], {"window": (4, 2), "softcap": 2.0}, id="window_softcap"),
]

# (d, dv, keywords) for the real-size GPU tests: every head-dim class, including
# non-powers of two and Dv != D, with no mask, causal, and window + sink + softcap.
GPU_HEAD_DIM_CASES = [
    pytest.param(d, dv, kw, id=f"d{d}_dv{dv}_" + "_".join(f"{a}{b}" for a, b in kw.items()))
    for d, dv in [(32, 32), (59, 59), (64, 64), (111, 111), (128, 128), (192, 128), (256, 256)]
    for kw in [{}, {"causal": True}, {"window": (100, 50), "sink": True, "softcap": 20.0}]
]
