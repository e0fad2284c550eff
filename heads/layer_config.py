"""The ``transformers`` config and class of a one-layer head's decoder layer (EAGLE-1, EAGLE-3), built from the
target's: one full-attention layer (:func:`one_layer_config`), of the sizes of the target layer it stands for
(:func:`head_source_layer`: Gemma-4's full-attention layers are wider than its sliding ones), and the check that a
target layer a head starts from has those sizes (:func:`check_init_layer`)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from selfspec.base.target_shards import module_class
from selfspec.heads.io import HeadFormatError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "FULL_ATTENTION",
    "HEAD_LAYER_OFF",
    "check_init_layer",
    "decoder_layer_class",
    "head_layer_config",
    "head_source_layer",
    "layer_overrides",
    "one_layer_config",
]

FULL_ATTENTION = "full_attention"
"""The layer type of the head's own attention: full context, never a sliding window."""


# Config fields the head's one layer turns off, with their off values: its attention sees its whole context (no
# sliding window, whatever the target's layers use: a copied window would make the head's cache drop keys), and it
# takes no per-layer token inputs (the per-layer embeddings of Gemma-3n / Gemma-4 layers, which the head does not
# compute). A field a family types strictly (Gemma-4's ``sliding_window: int``) keeps its value where the config
# has ``layer_types``: the head's one layer is then of type full attention and no window applies to it.
HEAD_LAYER_OFF: tuple[tuple[str, Any], ...] = (
    ("sliding_window", None),
    ("use_sliding_window", False),
    ("hidden_size_per_layer_input", 0),
)


def layer_overrides(arch_config: PretrainedConfig, layer: int) -> dict[str, Any]:
    """The attributes in which decoder layer ``layer`` differs from the global config, as ``transformers``' per-layer
    configs record them (``to_dict()["per_layer_config"]``: Gemma-4's full-attention layers have their own
    ``head_dim``); ``{}`` for a config whose layers are all alike."""
    raw = arch_config.to_dict().get("per_layer_config") or {}
    return dict({int(key): value for key, value in raw.items()}.get(layer, {}))


def head_source_layer(arch_config: PretrainedConfig) -> int:
    """The target layer whose sizes the head's one full-attention layer takes: the last ``"full_attention"`` layer of
    ``layer_types`` where the family has them (Gemma-4's full layers are wider than its sliding ones), else the last
    layer. 0 for a saved one-layer head config."""
    types = list(getattr(arch_config, "layer_types", None) or [])
    full = [i for i, kind in enumerate(types) if kind == FULL_ATTENTION]
    return full[-1] if full else arch_config.num_hidden_layers - 1


def check_init_layer(target_config: PretrainedConfig, layer: int, family: str) -> None:
    """Refuse to start a head's layer from target layer ``layer`` (negative: from the end) whose sizes are not the
    head's (:func:`head_source_layer`'s: Gemma-4's sliding layers have a smaller ``head_dim`` than its full ones).

    Raises:
        HeadFormatError: naming both layers and their per-layer sizes.
    """
    count = target_config.num_hidden_layers
    index = layer % count if -count <= layer < count else layer
    source = head_source_layer(target_config)
    if not 0 <= index < count:
        raise HeadFormatError(f"the target has {count} layers: no layer {layer} to start the {family} head from")
    own, theirs = layer_overrides(target_config, source), layer_overrides(target_config, index)
    if own != theirs:
        raise HeadFormatError(
            f"target layer {index} has sizes {theirs or 'of the config'} where the {family} head's full-attention "
            f"layer, like target layer {source}, has {own or 'those of the config'}: start it from layer {source} "
            "or from random"
        )


def one_layer_config(arch_config: PretrainedConfig) -> PretrainedConfig:
    """A deep copy of a transformers config with one full-attention layer (SDPA attention where the family
    has it, else eager).

    ``num_hidden_layers = 1``; ``layer_types`` (where the family has them) ``["full_attention"]``, every field of
    :data:`HEAD_LAYER_OFF` turned off (no sliding window, no per-layer inputs), and, for a config whose layers differ
    (``transformers``' per-layer configs), the layer's sizes those of :func:`head_source_layer` (Gemma-4: the full
    layers' ``head_dim``, which the target's full-attention rotary embedding the head calls is built for).
    Everything else (q/k norms, attention soft-capping, scalings) is the target's.

    Raises:
        HeadFormatError: a sliding-window field the config does not let the head turn off and no ``layer_types``
            to make its layer full attention instead.
    """
    from huggingface_hub.errors import StrictDataclassError  # what a strictly typed config raises on a bad value

    overrides = layer_overrides(arch_config, head_source_layer(arch_config))
    cfg = copy.deepcopy(arch_config)
    heterogeneous = "per_layer_config" in arch_config.to_dict()
    if heterogeneous:
        cfg.per_layer_config = None  # the global values readable again; the head's own layer's set below
    cfg.num_hidden_layers = 1
    typed = getattr(cfg, "layer_types", None) is not None
    if typed:
        cfg.layer_types = [FULL_ATTENTION]
    for name, off in HEAD_LAYER_OFF:
        if getattr(cfg, name, None) is not None:
            try:
                setattr(cfg, name, off)
            except StrictDataclassError as err:
                if not typed:
                    raise HeadFormatError(
                        f"{type(cfg).__name__} does not let a one-layer head turn off {name!r} ({err})"
                    ) from err
    if heterogeneous:
        cfg.per_layer_config = {0: {k: v for k, v in overrides.items() if k not in dict(HEAD_LAYER_OFF)}}
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        cfg._attn_implementation = "sdpa" if _supports_sdpa(cfg) else "eager"
    return cfg


def _supports_sdpa(config: PretrainedConfig) -> bool:
    """Whether the family's causal LM class runs SDPA attention (Gemma-2's soft-capped attention does not)."""
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return bool(getattr(model_cls, "_supports_sdpa", True)) if model_cls is not None else True


def decoder_layer_class(arch_config: PretrainedConfig, target: PreTrainedModel | None = None) -> type[nn.Module]:
    """The decoder layer class of an architecture: the class of ``target.model.layers[0]`` when a target is
    given (:func:`~selfspec.base.target_shards.module_class`: the layer's own class where it is sharded), else
    that of a meta-device (no memory) model built from ``arch_config``.

    Raises:
        HeadFormatError: the architecture has no ``model.layers`` stack.
    """
    if target is not None:
        layers = getattr(target.base_model, "layers", None)
    else:
        with torch.device("meta"):
            layers = getattr(AutoModelForCausalLM.from_config(arch_config).base_model, "layers", None)
    if not layers:
        raise HeadFormatError(f"model type {arch_config.model_type!r} has no decoder layer stack (model.layers)")
    return module_class(layers[0])


# ------------------------------------------------------------ what the one-layer heads (EAGLE-1, EAGLE-3) share
def head_layer_config(arch_config: PretrainedConfig, hidden_size: int, vocab_size: int) -> PretrainedConfig:
    """:func:`one_layer_config` of ``arch_config``, checked against the head's own sizes.

    Raises:
        HeadFormatError: the architecture's hidden or vocabulary size is not the head config's.
    """
    cfg = one_layer_config(arch_config)
    if (cfg.hidden_size, cfg.vocab_size) != (hidden_size, vocab_size):
        raise HeadFormatError(
            f"architecture config (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) "
            f"disagrees with the head config (hidden {hidden_size}, vocab {vocab_size})"
        )
    return cfg
