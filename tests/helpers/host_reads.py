"""Count the calls that read tensor values on the host (each a synchronisation on a GPU for a device tensor)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter

import torch

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


@contextlib.contextmanager
def counted_reads(sites: Counter, skip_files: tuple[str, ...] = ()):
    """Count, by method name in ``sites``, every read of tensor values on the host while the block runs.

    ``skip_files``: file names (e.g. ``"batch_cache.py"``) whose calls are not counted: modules whose tensors
    live on the host by design (a batch's slot table), so their reads never wait for a device.
    """
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def counted(name, orig):
        def call(self, *args, **kwargs):
            if not skip_files or os.path.basename(sys._getframe(1).f_code.co_filename) not in skip_files:
                sites[name] += 1
            return orig(self, *args, **kwargs)

        return call

    try:
        for name in READS:
            setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        yield
    finally:
        for name, orig in saved.items():
            if orig is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, orig)
