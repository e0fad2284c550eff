"""EAGLE-1 draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", arXiv:2401.15077), drafted as EAGLE-2 dynamic trees by :mod:`selfspec.decode.drafters.eagle`.

The head autoregresses on the target's *features*: ``f_t`` is the target's last hidden state at
position t AFTER the final norm (what :meth:`selfspec.decode.verifier.Verifier.prefill` returns, and what the
target's lm_head turns into the distribution of token ``x_{t+1}``). At head position t the input is the pair
``(f_t, x_{t+1})``::

    z_t    = fc(concat(embed(x_{t+1}), f_t))          # [.., 2D] -> [.., D]
    f'_t+1 = DecoderLayer(z)_t                       # one layer of the target's own architecture,
                                                     # input_layernorm replaced by identity
    logits = f'_t+1 @ lm_head[draft_ids].T           # target's frozen lm_head, no extra norm

Because features are after the target's final norm, the predicted feature goes through the lm_head
directly (as in EAGLE-1, whose features are Hugging Face's ``hidden_states[-1]``, also after the norm).
The token embedding, lm_head and rotary embedding are the target's and frozen; they are referenced
(never registered, never saved) through :meth:`EagleHead.attach_target`.

The decoder layer is built through ``transformers``' public classes from the target's config (the class
of ``target.model.layers[0]``, or of a meta-device model of the saved config), so a target of any family
with a ``model.layers`` stack and a rotary embedding works without copying a modeling file: its norms,
q/k norms and attention scalings come with the class. The head's own attention is always full-context
(layer type ``full_attention``, no sliding window, whatever the target's layers use), and a rotary embedding
with per-layer-type frequencies (Gemma-3) is called for that type.

Files (``save_pretrained``), laid out so EAGLE-1 serving engines load them (vLLM ``EagleLlamaForCausalLM``,
SGLang ``LlamaForCausalLMEagle``):

* ``config.json``: the target's config with ``num_hidden_layers: 1``, plus ``head_type: "eagle"`` and a
  ``selfspec`` object holding :class:`EagleConfig` (strictly checked);
* ``model.safetensors``: exactly ``fc.weight`` (+ ``fc.bias``) and ``layers.0.*``;
* ``draft_vocab.safetensors`` (only with a reduced draft vocabulary): ``draft_ids`` ``[S]``, kept out of
  the weights file so engines that load the full-vocabulary EAGLE-1 layout are not handed an unknown
  tensor. The head's weights do not depend on the vocabulary; only drafting restricts the lm_head rows.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from transformers import AutoConfig

from selfspec.base.cpu_linear import project
from selfspec.base.target_shards import layer_state
from selfspec.heads.config import check_family_fields, read_selfspec_config
from selfspec.heads.families import HeadFamily, register_head_family
from selfspec.heads.hub import HubMixin
from selfspec.heads.io import (
    CONFIG_NAME,
    DRAFT_VOCAB_NAME,
    WEIGHTS_NAME,
    HeadFormatError,
    check_draft_ids,
    load_state,
    read_config,
    read_safetensors,
    write_head_dir,
)
from selfspec.heads.layer_config import (
    FULL_ATTENTION,
    check_init_layer,
    decoder_layer_class,
    head_layer_config,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "CONFIG_NAME",
    "DRAFT_VOCAB_NAME",
    "FULL_ATTENTION",
    "WEIGHTS_NAME",
    "EagleConfig",
    "EagleHead",
    "decoder_layer_class",
    "head_layer_config",
    "logit_softcap",
    "read_layer_head",
    "rotary_layer_type",
    "run_layer",
    "softcap",
    "target_rotary",
    "write_layer_head",
]

C = TypeVar("C")


@dataclass(frozen=True)
class EagleConfig:
    """selfspec's own fields of an EAGLE head (the architecture lives in the transformers config).

    Attributes:
        hidden_size: D, the target's hidden size.
        vocab_size: V, the target's vocabulary size.
        draft_vocab_size: S lm_head rows used while drafting; None = the full vocabulary.
        fc_bias: whether ``fc`` (2D -> D) has a bias (EAGLE-1: yes).
        target: the target name the head was trained on (informational).
        target_fingerprint: :func:`selfspec.base.fingerprint.target_fingerprint` of that target; checked on load.
        heldout_top1: held-out teacher-forced top-1 accuracy vs the target's argmax, if measured.
        head_type: always ``"eagle"``.
    """

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int | None = None
    fc_bias: bool = True
    target: str = ""
    target_fingerprint: str = ""
    heldout_top1: float | None = None
    head_type: str = "eagle"

    def __post_init__(self) -> None:
        check_family_fields(self.head_type, "eagle", self.draft_vocab_size, self.vocab_size)

    @property
    def n_draft(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def cost_shape(self) -> str:
        """The sizes one head forward's cost depends on besides the target, as a file-name part of the draft-cost
        cache (:mod:`selfspec.decode.tuning.draft_costs`): the draft vocabulary and the ``fc`` bias."""
        return f"v{self.n_draft}-b{int(self.fc_bias)}"


def rotary_layer_type(rotary: nn.Module) -> str | None:
    """The ``layer_type`` argument the head passes to the target's rotary embedding: None when its
    ``forward`` takes no such argument (one set of frequencies for every layer, as in Llama); otherwise
    ``"full_attention"`` when the rotary has parameters for that type (Gemma-3: the global base), else the
    first type it has (``rotary.layer_types``)."""
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return None
    types = list(getattr(rotary, "layer_types", None) or [FULL_ATTENTION])
    return FULL_ATTENTION if FULL_ATTENTION in types else types[0]


def logit_softcap(config: PretrainedConfig) -> float | None:
    """The target's ``final_logit_softcapping`` (Gemma-2: logits ``cap * tanh(z / cap)``), or None."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (the identity when ``cap`` is None); any shape and float dtype."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def target_rotary(target: PreTrainedModel, arch_config: PretrainedConfig, family: str) -> tuple[nn.Module, dict]:
    """The target's rotary embedding and the keyword arguments a head of ``arch_config``'s type calls it with
    (``{"layer_type": ...}`` for per-layer-type frequencies, :func:`rotary_layer_type`; else ``{}``).

    Raises:
        HeadFormatError: the target is of another model type than the head's layer, or has no rotary embedding.
    """
    if target.config.model_type != arch_config.model_type:
        raise HeadFormatError(
            f"target is a {target.config.model_type!r} model, the head a {arch_config.model_type!r} layer"
        )
    rotary = getattr(target.base_model, "rotary_emb", None)
    if rotary is None:
        raise HeadFormatError(f"the target has no model.rotary_emb module; {family} heads need RoPE positions")
    layer_type = rotary_layer_type(rotary)
    return rotary, {} if layer_type is None else {"layer_type": layer_type}


def run_layer(
    layer: nn.Module,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    rotary: nn.Module,
    rotary_kwargs: dict,
) -> torch.Tensor:
    """One call of a head's decoder layer through its public ``forward``: ``hidden [B, T, D]`` at ``position_ids``
    (RoPE from the target's ``rotary``), the additive ``attention_mask`` and, when given, the head's one-layer
    ``cache`` (extended by T entries). Returns the layer's output ``[B, T, D]``."""
    position_embeddings = rotary(hidden, position_ids, **rotary_kwargs)
    kwargs: dict[str, Any] = {"cache": cache, "use_cache": True} if cache is not None else {}
    if _takes_shared_kv(type(layer)):
        kwargs["shared_kv_states"] = _kv_sharing_dict()
    out = layer(
        hidden,
        attention_mask=attention_mask,
        position_ids=position_ids,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    return out[0] if isinstance(out, tuple) else out


@functools.cache
def _takes_shared_kv(layer_cls: type) -> bool:
    # Layers of KV-sharing families (Gemma-4) store their keys for later layers in a dict the model passes each layer;
    # the head's one layer gets a fresh one per call (nothing reads it).
    return "shared_kv_states" in inspect.signature(layer_cls.forward).parameters


def _kv_sharing_dict() -> Any:
    from transformers.cache_utils import KVSharingDict  # only for the families that take one

    return KVSharingDict()


def write_layer_head(
    directory: str | Path, arch_config: PretrainedConfig, head_type: str, fields: dict, files: dict
) -> Path:
    """Write a one-layer head directory: ``config.json`` = the layer's transformers config with
    ``num_hidden_layers: 1``, ``head_type`` and the family's ``fields`` (its ``selfspec`` object and the serving
    layouts' keys), and ``files`` ({name: tensors}), atomically (:func:`selfspec.heads.io.write_head_dir`).
    Returns the directory."""
    config = arch_config.to_dict()
    config.update({"num_hidden_layers": 1, "head_type": head_type, **fields})
    config.pop("_attn_implementation_autoset", None)
    write_head_dir(directory, config, files, metadata={"head_type": head_type})
    return Path(directory)


def read_layer_head(
    directory: Path,
    head_type: str,
    family: str,
    config_cls: type[C],
    target: PreTrainedModel | None,
    target_fingerprint: str | None,
    pop_fields: Callable[[dict[str, Any], C], None] | None = None,
) -> tuple[C, PretrainedConfig]:
    """Read a one-layer head's ``config.json`` strictly: its ``selfspec`` object as ``config_cls`` and the rest as
    the layer's transformers config.

    Args:
        directory: the local head directory.
        head_type, family: the ``head_type`` it must name, and the family's name for messages.
        config_cls: the family's frozen config dataclass.
        target: when given, its model type must be the layer's.
        target_fingerprint: when given, must equal the stored fingerprint.
        pop_fields: removes (and checks) the family's own top-level keys before the rest is read as a
            transformers config.

    Returns:
        ``(config, arch_config)``.

    Raises:
        HeadFormatError: another ``head_type``, no or an invalid ``selfspec`` object, another target, not one
            layer, not a transformers config, or a layer of another model type than the target's.
    """
    where = directory / CONFIG_NAME
    raw = read_config(directory)
    if raw.pop("head_type", None) != head_type:
        raise HeadFormatError(f"{where} is not an {family} head (head_type must be {head_type!r})")
    config = read_selfspec_config(directory, raw, config_cls, target_fingerprint)
    if pop_fields is not None:
        pop_fields(raw, config)
    if raw.get("num_hidden_layers") != 1:
        raise HeadFormatError(f"{where}: an {family} head has num_hidden_layers 1")
    model_type = raw.pop("model_type", None)
    try:
        arch = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError) as err:
        raise HeadFormatError(f"{where}: not a transformers config ({err})") from err
    if target is not None and target.config.model_type != arch.model_type:
        raise HeadFormatError(f"head is a {arch.model_type!r} layer, the target a {target.config.model_type!r} model")
    return config, arch


class EagleHead(nn.Module, HubMixin):
    """EAGLE-1 feature head: ``fc`` + one decoder layer of the target's kind (see the module docstring).

    Parameters: ``fc.weight`` ``[D, 2D]`` (+ ``fc.bias`` ``[D]``) and ``layers.0.*``.
    Buffer (non-persistent, saved in its own file): ``draft_ids`` LongTensor ``[S]``, the target token id
    of each draft-vocabulary row (``arange(V)`` when full).

    Args:
        config: :class:`EagleConfig`.
        arch_config: the target's transformers config (copied; ``num_hidden_layers`` set to 1).
        draft_ids: optional LongTensor ``[S]`` of target ids forming the reduced draft vocabulary.
        target: the frozen target; when given, its decoder layer class is used and it is attached.
        init_from_target_layer: when a target is given, initialise ``layers.0`` from the target's last
            decoder layer (a good starting point for training; EAGLE itself starts from random).

    Raises:
        HeadFormatError: the architecture config disagrees with ``config``, or ``draft_ids`` is invalid.
    """

    # EAGLE-1 heads take the target's last hidden state (EAGLE-3 heads name three layers).
    target_layers = None

    def __init__(
        self,
        config: EagleConfig,
        arch_config: PretrainedConfig,
        draft_ids: torch.Tensor | None = None,
        target: PreTrainedModel | None = None,
        init_from_target_layer: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.arch_config = head_layer_config(arch_config, config.hidden_size, config.vocab_size)
        D, S = config.hidden_size, config.n_draft
        if draft_ids is None:
            draft_ids = torch.arange(config.vocab_size)
        check_draft_ids(draft_ids.to(torch.long), S, config.vocab_size, "EagleHead")
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone(), persistent=False)
        self.fc = nn.Linear(2 * D, D, bias=config.fc_bias)
        layer = decoder_layer_class(self.arch_config, target)(self.arch_config, layer_idx=0)
        if init_from_target_layer and target is not None:
            check_init_layer(target.config, -1, "EAGLE-1")
            src = layer_state(target.base_model.layers[-1])  # whole, where the target is sharded
            src = {k: v for k, v in src.items() if not k.startswith("input_layernorm.")}
            layer.load_state_dict(src, strict=False)
        # EAGLE-1: the first (here: only) layer has no input norm; fc's output enters attention directly.
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])
        self._target: tuple[Any, ...] | None = None  # (embed, rotary, lm_head weight [S, D]); not registered
        self._lm_cast: dict[torch.dtype, torch.Tensor] = {}
        self._rotary_kwargs: dict[str, str] = {}  # {"layer_type": ...} for per-layer-type rotary embeddings
        self.logit_softcap: float | None = None  # the target's final_logit_softcapping, set on attach
        if target is not None:
            self.attach_target(target)

    # ---------------------------------------------------------------- target
    def attach_target(self, target: PreTrainedModel) -> None:
        """Reference the frozen target's token embedding, rotary embedding and lm_head (rows ``draft_ids``).

        A rotary embedding with per-layer-type frequencies (its ``forward`` takes ``layer_type``, as
        Gemma-3's) is called for the head's own type, full attention (:func:`rotary_layer_type`); the
        target's ``final_logit_softcapping`` is kept for :meth:`draft_logits`.

        Raises:
            HeadFormatError: the target's sizes or model type differ from the head's.
        """
        cfg = target.config
        if (cfg.hidden_size, cfg.vocab_size) != (self.config.hidden_size, self.config.vocab_size):
            raise HeadFormatError(
                f"target has hidden {cfg.hidden_size} / vocab {cfg.vocab_size}, the EAGLE head expects "
                f"{self.config.hidden_size} / {self.config.vocab_size}: it belongs to another target."
            )
        rotary, self._rotary_kwargs = target_rotary(target, self.arch_config, "EAGLE")
        lm = target.get_output_embeddings().weight.detach()
        ids = self.draft_ids.to(lm.device)
        lm = lm if ids.numel() == lm.shape[0] else lm[ids]
        self._target = (target.get_input_embeddings(), rotary, lm)
        self._lm_cast = {}
        self.logit_softcap = logit_softcap(cfg)

    def _require_target(self) -> tuple[Any, ...]:
        if self._target is None:
            raise RuntimeError("EagleHead needs attach_target(target) (its embeddings, RoPE and lm_head) first")
        return self._target

    def lm_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The target's lm_head rows of the draft vocabulary, ``[S, D]`` in ``dtype`` (frozen, cached)."""
        lm = self._require_target()[2]
        if lm.dtype == dtype:
            return lm
        if dtype not in self._lm_cast:
            self._lm_cast[dtype] = lm.to(dtype)
        return self._lm_cast[dtype]

    # ---------------------------------------------------------------- compute
    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """Predict the next features.

        Args:
            features: ``[B, T, D]`` target features ``f_t`` (after the final norm), any float dtype.
            input_ids: LongTensor ``[B, T]``, the tokens ``x_{t+1}`` paired with them.
            position_ids: LongTensor ``[B, T]``.
            attention_mask: additive float ``[B or 1, 1, T, past + T]`` (0 attend, dtype-min blocked) or
                None for a plain causal mask without cache.
            cache: a ``transformers`` ``DynamicCache`` of the head (one layer), extended by T entries.

        Returns:
            Predicted features ``[B, T, D]`` in the head's dtype; position t predicts ``f_{t+1}``.
        """
        embed, rotary, _ = self._require_target()
        dtype = self.fc.weight.dtype
        with torch.no_grad():
            emb = embed(input_ids).to(dtype)
        x = self.fc(torch.cat([emb, features.to(dtype)], dim=-1))
        return run_layer(self.layers[0], x, position_ids, attention_mask, cache, rotary, self._rotary_kwargs)

    def draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` predicted features -> ``[..., S]`` logits over the draft vocabulary (row i scores
        target token ``draft_ids[i]``), in the features' dtype (:func:`selfspec.base.cpu_linear.project`:
        ``W @ h^T`` for 2..32 rows on a CPU), soft-capped as the target's own logits are (Gemma-2's
        ``final_logit_softcapping``), so the draft distribution is the target's lm_head applied to the
        predicted feature."""
        return softcap(project(predicted, self.lm_weight(predicted.dtype)), self.logit_softcap)

    # ---------------------------------------------------------------- files
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json``, ``model.safetensors`` and, with a reduced vocabulary, ``draft_vocab.safetensors``,
        atomically (:func:`selfspec.heads.io.write_head_dir`: other files of an existing directory are kept).

        Head weights only: never the target's embeddings or lm_head. Returns the directory.
        """
        files = {WEIGHTS_NAME: self.state_dict()}
        if self.config.draft_vocab_size is not None:
            files[DRAFT_VOCAB_NAME] = {"draft_ids": self.draft_ids}
        return write_layer_head(
            directory, self.arch_config, "eagle", {"selfspec": dataclasses.asdict(self.config)}, files
        )

    @classmethod
    def from_directory(
        cls, directory: str | Path, target: PreTrainedModel | None = None, target_fingerprint: str | None = None
    ) -> EagleHead:
        """Load a head saved by :meth:`save_pretrained` from a local directory, refusing anything that does not
        match exactly (``from_pretrained`` also takes a Hub repo id: :class:`~selfspec.heads.hub.HubMixin`).

        Args:
            directory: the head directory.
            target: the frozen target, attached after loading (its decoder layer class is used).
            target_fingerprint: if given, must equal the fingerprint stored with the head.

        Raises:
            HeadFormatError: missing/corrupt files, unknown ``selfspec`` keys, an architecture that is not
                one layer, missing or unexpected tensors, wrong shapes or dtypes of ``draft_ids``, or a head
                trained on another target. Nothing is half-loaded.
        """
        d = Path(directory)
        config, arch = read_layer_head(d, "eagle", "EAGLE-1", EagleConfig, target, target_fingerprint)
        state = read_safetensors(d / WEIGHTS_NAME)
        draft_ids = None
        if config.draft_vocab_size is not None:
            vocab = read_safetensors(d / DRAFT_VOCAB_NAME)
            if set(vocab) != {"draft_ids"}:
                raise HeadFormatError(f"{d / DRAFT_VOCAB_NAME} must hold exactly 'draft_ids', has {sorted(vocab)}")
            draft_ids = vocab["draft_ids"]
            check_draft_ids(draft_ids, config.n_draft, config.vocab_size, str(d / DRAFT_VOCAB_NAME))
        head = cls(config, arch, draft_ids=draft_ids, target=target)
        load_state(head, d / WEIGHTS_NAME, state)
        return head


register_head_family(HeadFamily("eagle", "EAGLE-1", EagleHead, EagleHead.from_directory))
