"""Memory of online adaptation and the served history over 1,000 requests (round 19).

A tiny random target (tests/helpers) with an EAGLE-3 head, ``adapt=OnlineOptions(...)`` and ``hybrid=True,
history=True``; 1,000 requests of 4-19 random prompt tokens and 32 new tokens. Prints, every 100 requests, the
process's peak resident memory, the bytes the replay buffers hold and the tokens the history holds, then the
buffers' declared bound. Run from the repository root: ``python docs/results/round19/online_memory.py``.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the tests' helpers

import selfspec  # noqa: E402
from selfspec.train.online import OnlineOptions  # noqa: E402
from tests.helpers.archs import tiny_llama  # noqa: E402
from tests.helpers.heads import make_eagle3  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    target = tiny_llama(vocab_size=96, hidden_size=32, layers=3)
    opts = OnlineOptions(window=8, steps_per_request=2, batch_tokens=256, max_length=64, buffer_tokens=2048)
    model = selfspec.load(
        target, make_eagle3(target), adapt=opts, tune="off", depth=3, top_k=2, total_tokens=6, hybrid=True, history=True
    )
    g = torch.Generator().manual_seed(0)
    t0 = time.time()
    for i in range(1000):
        ids = torch.randint(3, 96, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g)
        model.generate(ids, max_new_tokens=32, eos_token_id=[])
        if (i + 1) % 100 == 0:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
            print(
                f"requests {i + 1}  max RSS {peak} MiB  buffer {model.online.memory_bytes()} bytes  "
                f"history {model.history.num_tokens} tokens"
            )
    bound = (opts.buffer_tokens + opts.buffer_tokens // 4 + 2 * opts.max_length) * (4 * 32 * 4 + 8)
    stats = model.online.stats
    print(
        f"declared buffer bound {bound} bytes; swaps {stats.swaps} rollbacks {stats.rollbacks} steps {stats.steps} "
        f"s {round(time.time() - t0)}"
    )


if __name__ == "__main__":
    main()
