"""Time the three linear kernels of tree verification (decode/cpu_linear.py) on SmolLM2-135M's linear shapes.

    python scripts/linear_kernels.py [--threads 2] [--repeats 7]

For 1..24 rows: summed median ms over the 210 backbone weights (random weights of the real shapes) for
plain ``linear``, ``W @ x^T`` and oneDNN on weights packed once, then the lm_head (49,152 x 576) alone;
each size's kernels are interleaved. Ends with the resident-memory growth when the real target's weights
are packed (``Verifier.set_plan``). CPU only; the figures quoted in docs/RESULTS.md (round 5) came from it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from selfspec.decode import cpu_linear
from selfspec.decode.verifier import Verifier

SHAPES = {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30}  # SmolLM2-135M: 30 layers
LM_HEAD = (49152, 576)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = {**SHAPES, LM_HEAD: 1}
    weights = {s: [torch.randn(*s) * 0.02 for _ in range(n)] for s, n in shapes.items()}
    packed = {s: [cpu_linear.pack_weight(w) for w in ws] for s, ws in weights.items()}
    kernels = {
        "linear": lambda x, w, pw: F.linear(x, w),
        "W @ x^T": lambda x, w, pw: torch.mm(w, x.T),
        "packed": lambda x, w, pw: cpu_linear.packed_linear(x, pw, None),
    }
    print(f"{'rows':>4} " + " ".join(f"{k:>9}" for k in kernels) + " | lm_head " + " ".join(f"{k:>9}" for k in kernels))
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 6, 8, 12, 16, 24):
            times = {(k, s): [] for k in kernels for s in shapes}
            xs = {s: torch.randn(rows, s[1]) for s in shapes}
            for r in range(args.repeats + 1):
                for k, fn in kernels.items():
                    for s in shapes:
                        t0 = time.perf_counter()
                        for w, pw in zip(weights[s], packed[s], strict=True):
                            fn(xs[s], w, pw)
                        if r:  # the first round warms up
                            times[k, s].append((time.perf_counter() - t0) * 1e3)
            med = {key: statistics.median(v) for key, v in times.items()}
            backbone = [sum(med[k, s] for s in SHAPES) for k in kernels]
            head = [med[k, LM_HEAD] for k in kernels]
            print(
                f"{rows:>4} "
                + " ".join(f"{v:9.1f}" for v in backbone)
                + " |         "
                + " ".join(f"{v:9.1f}" for v in head)
            )

        from selfspec.target import load_target

        model = load_target("smollm2-135m-instruct")[0].eval()
        verifier = Verifier(model)
        verifier.prefill(torch.arange(64), verifier.new_cache())  # touch every weight
        before = _rss_mb()
        verifier.set_plan({2: "packed"})
        grown = _rss_mb() - before
        size = verifier.packed_bytes
        print(
            f"packing SmolLM2-135M's linear + lm_head weights ({size / 2**20:.0f} MB): resident memory +{grown:.0f} MB"
        )


if __name__ == "__main__":
    main()
