"""The drafter that never drafts: each step verifies the root alone, one token per step (plain decoding).

Through the decode loop and a tuned :class:`~selfspec.decode.verifier.Verifier` it is the **engine-only
baseline**: the same kernels, cache handling and exact step as every speculative method, with no
speculation. A method's speedup over it is the gain of speculation alone; its speedup over
``transformers`` ``generate`` is the gain of the engine's kernels.
"""

from __future__ import annotations

import torch

from selfspec.decode.drafters.base import Drafter, DrafterInfo, DraftLimit
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree, root_only


class NoDraftDrafter(Drafter):
    """Proposes the root alone (``max_depth = 0``); the loop then takes the plain step without reading a tree.

    Greedy output equals ``generate``'s token for token and tau is exactly 1 (one token per verification).
    """

    def info(self) -> DrafterInfo:
        return DrafterInfo(name="no_draft", max_depth=0)

    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """The tree of ``context[-1]`` alone."""
        return root_only(context)
