"""Host time of ``attention_varlen``'s forward on the H200: the persistent varlen kernel (its
block list made by a second launch into a fresh buffer) against the grid kernel, and the
device time of each.

Host time on 2 causal documents of 1k tokens (H = 16, D = 128, bf16: 256 items, more than
the SMs, so the persistent kernel takes the call; ~20 us of GPU work, so the GPU queue
absorbs the loop, as profile_host.py's rows); device time on 16 documents of 1k.

    python benchmarks/host_varlen.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# The repo root last: a PYTHONPATH tree (an in-turn A/B's .before) comes first.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import host_loop_s, median_ms  # noqa: E402

import flashlse as fl  # noqa: E402


def varlen_call(n_doc, s=1024, h=16, d=128):
    q = torch.randn(n_doc * s, h, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, n_doc * s + 1, s, dtype=torch.int32, device="cuda")
    return lambda: fl.attention_varlen(q, q, q, cu, cu, s, s, causal=True)


def main():
    small, large = varlen_call(2), varlen_call(16)
    print(f"attention_varlen fwd, causal 1k documents, H=16 D=128: "
          f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for on in (True, False, True):
        with torch.no_grad(), fl.kernel_options(fwd_sm90_config={"PERSISTENT_VARLEN": on}):
            host = host_loop_s(small, 2000, sync_end=False) * 1e6
            device_small, device_large = median_ms(small), median_ms(large)
        print(f"  PERSISTENT_VARLEN={on!s:<6} host {host:6.1f} us a call (2 docs; device "
              f"{device_small:.3f} ms); 16 docs: device {device_large:.3f} ms")


if __name__ == "__main__":
    main()
