"""selfspec: self-speculative decoding with draft heads trained on a frozen Hugging Face causal LM.

Quick use::

    import selfspec
    model = selfspec.load("smollm2-135m-instruct", "runs/medusa-smollm2/heads")
    out = model.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=64)
    print(out.text, out.stats.mean_accepted_tokens, out.stats.tokens_per_s)
"""

from __future__ import annotations

__version__ = "0.1.0"

from selfspec.base.lazy import lazy_exports

__all__ = ["SpeculativeModel", "from_pretrained", "load", "make_drafter", "__version__"]

# Imported on first use (``import selfspec`` itself imports nothing heavy: every selfspec module runs this file).
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "SpeculativeModel": "selfspec.api",
        "from_pretrained": "selfspec.api",
        "load": "selfspec.api",
        "make_drafter": "selfspec.api",
    },
)
