"""Draft heads (nn.Modules only): Medusa-1, EAGLE-1/2, EAGLE-3, and the block drafters DFlash and DSpark.

``load_heads(directory)`` (:mod:`selfspec.heads.load`) reads ``config.json`` and loads it with the loader its
``head_type`` names in the family registry (:mod:`selfspec.heads.families`, which imports a built-in family's module
the first time the family is asked for); every family reads and writes its directory through
:mod:`selfspec.heads.io`, and takes a Hub repo id for the directory and pushes to the Hub through
:mod:`selfspec.heads.hub`.
"""

from selfspec.base.lazy import lazy_exports

__all__ = [
    "BlockHead",
    "Eagle3Head",
    "EagleHead",
    "HeadFormatError",
    "MedusaHeads",
    "head_families",
    "head_family",
    "load_heads",
]

# Imported on first use: ``import selfspec.heads.io`` loads neither the head modules nor the Hub client.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "BlockHead": "selfspec.heads.dflash",
        "Eagle3Head": "selfspec.heads.eagle3",
        "EagleHead": "selfspec.heads.eagle",
        "HeadFormatError": "selfspec.heads.io",
        "MedusaHeads": "selfspec.heads.medusa",
        "head_families": "selfspec.heads.families",
        "head_family": "selfspec.heads.families",
        "load_heads": "selfspec.heads.load",
    },
)
