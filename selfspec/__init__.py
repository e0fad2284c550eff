"""selfspec: self-speculative decoding with draft heads trained on a frozen Hugging Face causal LM.

Quick use::

    import selfspec
    model = selfspec.load("smollm2-135m-instruct", "runs/medusa-smollm2/heads")
    out = model.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=64)
    print(out.text, out.stats.mean_accepted_tokens, out.stats.tokens_per_s)
"""

from __future__ import annotations

__version__ = "0.1.0"

import selfspec.hub  # noqa: F401 (registers the upload of every head family's push_to_hub)
from selfspec.api import SpeculativeModel, from_pretrained, load, make_drafter

__all__ = ["SpeculativeModel", "from_pretrained", "load", "make_drafter", "__version__"]
