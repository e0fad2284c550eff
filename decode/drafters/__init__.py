"""Drafters: what proposes the draft tree each step, one class per way of drafting on one base class.

* :class:`~selfspec.decode.drafters.base.Drafter`: the contract (``info`` / ``begin`` / ``propose`` /
  ``accept`` / ``fork``) and the records it passes (:class:`DrafterInfo`, :class:`DraftLimit`,
  :class:`AcceptedPath`).
* :class:`MedusaDrafter`: Medusa heads on the target's hidden state, a static tree (Cai et al. 2024).
* :class:`EagleDrafter`: an EAGLE-1 or EAGLE-3 head growing an EAGLE-2 dynamic tree (Li et al. 2024).
* :class:`PromptLookupDrafter`: n-gram match in the context (Saxena 2023, "prompt lookup decoding").
* :class:`DraftModelDrafter`: a separate small causal LM with the target's tokenizer (Leviathan et al. 2023).
* :class:`BlockDrafter`: a DFlash or DSpark head drafting a whole block in one forward (arXiv:2602.06036).
* :class:`HybridDrafter`: a head's tree merged with n-gram continuations, split by measured cost.
"""

from selfspec.base.lazy import lazy_exports

__all__ = [
    "AcceptedPath",
    "BlockDrafter",
    "DraftLimit",
    "DraftModelDrafter",
    "DraftTree",
    "Drafter",
    "DrafterInfo",
    "EagleDrafter",
    "HybridDrafter",
    "MedusaDrafter",
    "NoDraftDrafter",
    "PromptLookupDrafter",
    "context_length",
]

# Imported on first use: one drafter (and the base class every drafter imports) loads without the others.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AcceptedPath": "selfspec.decode.drafters.base",
        "BlockDrafter": "selfspec.decode.drafters.block",
        "DraftLimit": "selfspec.decode.drafters.base",
        "DraftModelDrafter": "selfspec.decode.drafters.draft_model",
        "DraftTree": "selfspec.decode.tree",
        "Drafter": "selfspec.decode.drafters.base",
        "DrafterInfo": "selfspec.decode.drafters.base",
        "EagleDrafter": "selfspec.decode.drafters.eagle",
        "HybridDrafter": "selfspec.decode.drafters.hybrid",
        "MedusaDrafter": "selfspec.decode.drafters.medusa",
        "NoDraftDrafter": "selfspec.decode.drafters.no_draft",
        "PromptLookupDrafter": "selfspec.decode.drafters.prompt_lookup",
        "context_length": "selfspec.decode.drafters.base",
    },
)
