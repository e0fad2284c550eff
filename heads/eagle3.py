"""EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840), drafted as EAGLE-2 dynamic trees by
:class:`selfspec.decode.drafters.eagle.EagleDrafter`.

The head fuses three of the target's layers instead of its last feature. At head position t the input is the
pair ``(g_t, x_{t+1})``, where ``g_t`` is either the target's hidden states at position t entering layers
``target_layers = (low, mid, high)`` (``hidden_states[i]`` of ``transformers``, concatenated: ``[.., 3D]``) or,
while drafting beyond the first token, the head's own output at the previous draft position (``[.., D]``)::

    h_t    = fc(g_t)  if g_t is [.., 3D]  else  g_t           # fc: 3D -> D, no bias
    a_t    = concat(input_norm(embed(x_{t+1})), hidden_norm(h_t))   # [.., 2D]: the attention input
    o_t    = DecoderLayer(h_t; attention over a)               # one layer of the target's own class,
                                                               # residual h_t, q/k/v taking 2D inputs
    logits = lm_head(norm(o_t))                                # [.., S] over the draft vocabulary

``o_t`` predicts token ``x_{t+2}``; it is also what the next draft position takes as ``g``. Draft id i is target
id ``i + d2t[i]`` (:attr:`Eagle3Head.draft_ids`); ``t2d`` marks the target ids that have a draft id.

EAGLE-3.1 (arXiv:2605.09992, the EAGLE / vLLM / TorchSpec release) adds two options (:class:`Eagle3Config`), the
functions of the ``speculators`` package's ``Eagle3DraftModel`` with the flags of the same names:

* ``fc_norm``: ``h_t = fc(concat(fc_norm[0](g_low), fc_norm[1](g_mid), fc_norm[2](g_high)))``, one norm of the
  family's class per fused layer (``fc_norm.{0,1,2}.weight [D]``), so the three layers weigh alike whatever their
  scale (a draft position's D-wide ``g`` skips ``fc`` and these norms, as above);
* ``norm_output``: the next draft position takes ``norm(o_t)`` as ``g`` instead of ``o_t`` (no new tensor; the
  logits are ``lm_head(norm(o_t))`` either way), so the magnitudes fed back do not drift with depth.

The decoder layer is built through ``transformers`` from a one-layer, full-attention copy of the target's config
(:func:`selfspec.heads.eagle.decoder_layer_class`), so norms, q/k norms and scalings are the family's own; only its
q/k/v (or fused qkv) projections are rebuilt with 2D inputs, and its ``input_layernorm`` becomes
:class:`FusedInputNorm` (the two norms above, each of the family's norm class). A target whose attention reads the
hidden states through other projections too (DeepSeek's latent attention), or whose layer has no
``input_layernorm`` (LFM2), gets a Llama layer of its sizes instead, with RoPE of its own (``draft_layer``,
:mod:`selfspec.heads.eagle3_layer`). The token embedding and the rotary
embedding are the target's, frozen, referenced through :meth:`Eagle3Head.attach_target`, never saved.

Files (``save_pretrained``), tensor names as the EAGLE-3 serving layouts use them (``docs/ARCHITECTURE.md``,
"Facts this design rests on"; the file trees: ``docs/EXPORT.md``):

* ``config.json``: the target's config with ``num_hidden_layers: 1``, ``head_type: "eagle3"``,
  ``draft_vocab_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids`` and a ``selfspec`` object
  (:class:`Eagle3Config`, strictly checked);
* ``model.safetensors``: ``fc.weight [D, 3D]``, ``layers.0.hidden_norm.weight``, ``layers.0.input_layernorm.weight``,
  ``layers.0.self_attn.{q,k,v}_proj.weight [., 2D]`` (Phi-3: ``qkv_proj``), the rest of ``layers.0.*``,
  ``norm.weight``, ``lm_head.weight [S, D]``, ``d2t`` int64 ``[S]`` and ``t2d`` bool ``[V]``; with ``fc_norm`` also
  ``fc_norm.{0,1,2}.weight [D]``; no embeddings.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from selfspec.base.cpu_linear import project
from selfspec.base.target_shards import layer_state
from selfspec.heads.config import check_family_fields, check_layer_ids
from selfspec.heads.eagle import (
    logit_softcap,
    read_layer_head,
    run_layer,
    softcap,
    target_rotary,
    write_layer_head,
)
from selfspec.heads.eagle3_layer import DRAFT_LAYERS, FusedInputNorm, draft_layer_arch, widen_qkv
from selfspec.heads.families import HeadFamily, register_head_family
from selfspec.heads.hub import HubMixin
from selfspec.heads.io import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError, load_state, read_safetensors
from selfspec.heads.layer_config import check_init_layer, head_layer_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "Eagle3Config",
    "Eagle3Head",
    "FusedInputNorm",
    "check_vocab_maps",
    "default_target_layers",
    "vocab_maps",
]

# Module names of this implementation -> the tensor names of the published EAGLE-3 layout.
_FILE_NAMES = {
    "layers.0.input_layernorm.embed_norm.weight": "layers.0.input_layernorm.weight",
    "layers.0.input_layernorm.hidden_norm.weight": "layers.0.hidden_norm.weight",
}


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """The published choice ``(2, L // 2, L - 3)`` of layers whose input hidden states the head fuses, each
    clamped into ``[0, L - 1]`` and sorted, so tiny targets get valid (possibly repeated) layers: L = 3 gives
    ``(0, 1, 2)``, L = 2 gives ``(0, 1, 1)``, L = 30 (SmolLM2-135M) gives ``(2, 15, 27)``.

    Raises:
        ValueError: ``num_layers < 1``.
    """
    if num_layers < 1:
        raise ValueError(f"a target needs at least one layer, got {num_layers}")
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's maps of a draft vocabulary: ``d2t`` int64 ``[S]`` (draft id i is target id ``i + d2t[i]``) and
    ``t2d`` bool ``[V]`` (True at target ids that have a draft id), from the ascending target ids ``draft_ids [S]``.

    Raises:
        HeadFormatError: ``draft_ids`` not strictly ascending or outside ``[0, V)`` (see :func:`check_vocab_maps`).
    """
    ids = draft_ids.to(torch.long)
    d2t = ids - torch.arange(ids.numel(), device=ids.device)
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=ids.device)
    if ids.numel() and 0 <= int(ids.min()) and int(ids.max()) < vocab_size:
        t2d[ids] = True
    check_vocab_maps(d2t, t2d, ids.numel(), vocab_size, "draft vocabulary")
    return d2t, t2d


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, size: int, vocab_size: int, where: str) -> None:
    """Refuse maps that are not an exact, ordered draft vocabulary of ``size`` (S) of the V target ids.

    Raises:
        HeadFormatError: ``d2t`` not int64 ``[S]`` or ``t2d`` not bool ``[V]``; a mapped id ``i + d2t[i]`` outside
            ``[0, V)``, repeated or out of order; ``t2d`` not True exactly at the mapped ids.
    """
    if d2t.dtype != torch.long or tuple(d2t.shape) != (size,):
        raise HeadFormatError(f"{where}: d2t must be int64 [{size}], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
        raise HeadFormatError(f"{where}: t2d must be bool [{vocab_size}], got {t2d.dtype} {tuple(t2d.shape)}")
    ids = torch.arange(size, device=d2t.device) + d2t
    if size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise HeadFormatError(f"{where}: d2t maps a draft id outside the target vocabulary [0, {vocab_size})")
    if size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise HeadFormatError(f"{where}: d2t must map draft ids to strictly ascending target ids")
    expected = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    expected[ids] = True
    if not torch.equal(t2d.to(d2t.device), expected):
        raise HeadFormatError(f"{where}: t2d is not True exactly at the target ids of d2t")


@dataclass(frozen=True)
class Eagle3Config:
    """selfspec's own fields of an EAGLE-3 head (the architecture lives in the transformers config).

    Attributes:
        hidden_size: D, the target's hidden size.
        vocab_size: V, the target's vocabulary size.
        draft_vocab_size: S, rows of the head's lm_head (S = V for the full vocabulary).
        num_target_layers: L, the target's decoder layers (checked on attach).
        target_layers: the three layers whose input hidden states (``hidden_states[i]``) are fused, each in
            ``[0, L)``; default :func:`default_target_layers`.
        target: the target name the head was trained on (informational).
        target_fingerprint: :func:`selfspec.base.fingerprint.target_fingerprint` of that target; checked on load.
        heldout_top1: held-out teacher-forced top-1 agreement with the target's greedy token, if measured.
        fc_norm: EAGLE-3.1 (arXiv:2605.09992): a norm on each fused target layer before ``fc``.
        norm_output: EAGLE-3.1: the next draft step takes the head's output after the final norm.
        draft_layer: the head's decoder layer (:data:`DRAFT_LAYERS`): ``"target"``, the target's own layer class
            with q/k/v widened; ``"llama"``, a Llama decoder layer of the target's sizes with RoPE of its own (the
            layer the engines' EAGLE-3 layouts for DeepSeek and Kimi targets use), for a target whose attention
            reads the hidden states through other projections too (multi-head latent attention's
            ``kv_a_proj_with_mqa``); ``"auto"``, ``"target"`` where the target's attention can be widened, else
            ``"llama"``. A built head's config names the layer it has (never ``"auto"``).
        head_type: always ``"eagle3"``.

    Both EAGLE-3.1 fields default to False, the EAGLE-3 head; a head directory written before they existed reads
    as that.

    Raises:
        ValueError: sizes or layers out of range. HeadFormatError: another ``head_type``.
    """

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    num_target_layers: int
    target_layers: tuple[int, ...] | None = None
    target: str = ""
    target_fingerprint: str = ""
    heldout_top1: float | None = None
    fc_norm: bool = False
    norm_output: bool = False
    draft_layer: str = "auto"
    head_type: str = "eagle3"

    def __post_init__(self) -> None:
        check_family_fields(self.head_type, "eagle3", self.draft_vocab_size, self.vocab_size)
        if self.draft_layer not in DRAFT_LAYERS:
            raise ValueError(f"draft_layer must be one of {DRAFT_LAYERS}, got {self.draft_layer!r}")
        layers = default_target_layers(self.num_target_layers) if self.target_layers is None else self.target_layers
        layers = check_layer_ids("target_layers", layers, 0, self.num_target_layers - 1, count=3)  # layer inputs
        object.__setattr__(self, "target_layers", layers)

    @property
    def n_draft(self) -> int:
        """S, the draft vocabulary size (the name the EAGLE drafter reads)."""
        return self.draft_vocab_size

    @property
    def eagle31_flags(self) -> tuple[str, ...]:
        """The EAGLE-3.1 options this head sets, by their speculators names (``()`` for an EAGLE-3 head): what an
        export to an engine that computes neither must refuse."""
        return tuple(name for name, on in (("fc_norm", self.fc_norm), ("norm_output", self.norm_output)) if on)

    @property
    def cost_shape(self) -> str:
        """The sizes one head forward's cost depends on besides the target, as a file-name part of the draft-cost
        cache (:mod:`selfspec.decode.tuning.draft_costs`): the draft vocabulary and EAGLE-3.1's norms (the fc over
        three layers, without a bias, is the family's own)."""
        return f"v{self.draft_vocab_size}" + "".join(f"-{flag}" for flag in self.eagle31_flags)


class Eagle3Head(nn.Module, HubMixin):
    """EAGLE-3 head: ``fc`` over three target layers + one decoder layer of the target's class + final norm +
    lm_head over a reduced draft vocabulary (see the module docstring for the computation and tensor names);
    with ``config.fc_norm`` / ``config.norm_output``, the EAGLE-3.1 head (arXiv:2605.09992).

    Args:
        config: :class:`Eagle3Config`.
        arch_config: the target's transformers config (copied: one full-attention layer).
        draft_ids: LongTensor ``[S]`` of strictly ascending target ids (default ``arange(S)``).
        target: the frozen target; when given, its decoder layer class is used and it is attached.
        init_layer: with a target, start the decoder layer from the target's layer ``init_layer`` (negative
            counts from the end): every tensor copied, the target's q/k/v weights in the columns that read
            ``hidden_norm(h)`` (the embedding columns keep their random init), its input norm as
            ``hidden_norm``. None: random (the published start).
        init_lm_head: with a target, start ``lm_head`` from the target's lm_head rows ``draft_ids`` and ``norm``
            from the target's final norm (with the target's own layer class), so the untrained head's output map is the
            target's.

    Raises:
        HeadFormatError: the architecture disagrees with ``config``, or the vocabulary maps are invalid.
    """

    def __init__(
        self,
        config: Eagle3Config,
        arch_config: PretrainedConfig,
        draft_ids: torch.Tensor | None = None,
        target: PreTrainedModel | None = None,
        init_layer: int | None = None,
        init_lm_head: bool = False,
    ) -> None:
        super().__init__()
        D, S, V = config.hidden_size, config.draft_vocab_size, config.vocab_size
        kind, arch_config, layer_cls = draft_layer_arch(config.draft_layer, arch_config, target)
        self.config = dataclasses.replace(config, draft_layer=kind)
        self.arch_config = head_layer_config(arch_config, D, V)
        d2t, t2d = vocab_maps(torch.arange(S) if draft_ids is None else draft_ids, V)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.fc = nn.Linear(3 * D, D, bias=False)
        layer = layer_cls(self.arch_config, layer_idx=0)
        qkv = widen_qkv(layer.self_attn, 2 * D)
        # A Llama layer's RoPE is its own (the target's is built for the target's head size); not registered, so
        # neither saved nor cast with the head's dtype
        self._own_rotary = (LlamaRotaryEmbedding(self.arch_config),) if kind == "llama" else ()
        embed_norm = layer.input_layernorm
        # EAGLE-3.1: one norm per fused layer, of the family's class, freshly initialised (speculators' start)
        self.fc_norm = nn.ModuleList(copy.deepcopy(embed_norm) for _ in range(3)) if config.fc_norm else None
        layer.input_layernorm = FusedInputNorm(embed_norm, copy.deepcopy(embed_norm))
        self.layers = nn.ModuleList([layer])
        self.norm = copy.deepcopy(embed_norm)
        self.lm_head = nn.Linear(D, S, bias=False)
        self._target: tuple[nn.Module, nn.Module] | None = None  # (embed, rotary); not registered
        self._rotary_kwargs: dict[str, str] = {}
        self.logit_softcap: float | None = None
        if target is not None:
            self._init_from(target, init_layer, init_lm_head, qkv)
            self.attach_target(target)

    @torch.no_grad()
    def _init_from(self, target: PreTrainedModel, init_layer: int | None, init_lm_head: bool, qkv: list[str]) -> None:
        D = self.config.hidden_size
        if init_layer is not None and self.config.draft_layer == "target":  # a Llama layer starts from random
            layers = target.base_model.layers
            check_init_layer(target.config, init_layer, "EAGLE-3")
            src = layer_state(layers[init_layer])  # whole, where the target is sharded
            norm_w = src.pop("input_layernorm.weight", None)
            own = self.layers[0]
            for name in qkv:
                w = src.pop(f"self_attn.{name}.weight")
                getattr(own.self_attn, name).weight[:, D:] = w
            own.load_state_dict(src, strict=False)
            if norm_w is not None:
                own.input_layernorm.hidden_norm.weight.copy_(norm_w)
        if init_lm_head:
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[self.draft_ids.to(self.d2t.device)])
            if self.config.draft_layer == "target":  # a Llama layer's norm is its own class (starts at ones)
                self.norm.load_state_dict(target.base_model.norm.state_dict())

    # ---------------------------------------------------------------- target
    @property
    def draft_ids(self) -> torch.Tensor:
        """LongTensor ``[S]``: the target id of each draft id, ``arange(S) + d2t`` (the one place d2t is applied)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target layers whose input hidden states the head takes (drafters pass them to ``begin``/``accept``)."""
        return self.config.target_layers

    def attach_target(self, target: PreTrainedModel) -> None:
        """Reference the frozen target's token embedding and rotary embedding (never registered or saved); keep
        its ``final_logit_softcapping`` for :meth:`draft_logits`.

        Raises:
            HeadFormatError: the target's sizes, layer count or model type differ from the head's, or it has
                no rotary embedding.
        """
        cfg = target.config
        want = (self.config.hidden_size, self.config.vocab_size, self.config.num_target_layers)
        if (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers) != want:
            raise HeadFormatError(
                f"target has hidden {cfg.hidden_size} / vocab {cfg.vocab_size} / {cfg.num_hidden_layers} layers, "
                f"the EAGLE-3 head expects {want[0]} / {want[1]} / {want[2]}: it belongs to another target."
            )
        if self._own_rotary:
            rotary, self._rotary_kwargs = self._own_rotary[0], {}
        else:
            rotary, self._rotary_kwargs = target_rotary(target, self.arch_config, "EAGLE-3")
        self._target = (target.get_input_embeddings(), rotary)
        self.logit_softcap = logit_softcap(cfg)

    # ---------------------------------------------------------------- compute
    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        """The head's output at each position: what :meth:`draft_logits` scores and the next draft position takes
        as ``features`` (the layer's output ``o``, or ``norm(o)`` with ``norm_output``).

        Args:
            features: ``[B, T, 3D]`` the target's hidden states at ``target_layers`` (concatenated in that order;
                each D-wide slice normed by its ``fc_norm`` first with ``fc_norm``), or ``[B, T, D]`` the head's
                own outputs (draft positions after the first); any float dtype.
            input_ids: LongTensor ``[B, T]``, target ids of the tokens ``x_{t+1}`` paired with them.
            position_ids: LongTensor ``[B, T]``.
            attention_mask: additive float ``[B or 1, 1, T, past + T]`` (0 attend, dtype-min blocked), or None for
                a plain causal mask without cache.
            cache: a ``transformers`` ``DynamicCache`` of the head (one layer), extended by T entries.

        Returns:
            ``[B, T, D]`` in the head's dtype, before the final norm (after it with ``norm_output``): position t
            scores token ``x_{t+2}`` (:meth:`draft_logits`) and is the next draft position's ``features``.

        Raises:
            RuntimeError: no target attached. ValueError: ``features`` neither 3D nor D wide.
        """
        if self._target is None:
            raise RuntimeError("Eagle3Head needs attach_target(target) (its embeddings and RoPE) first")
        embed, rotary = self._target
        D, dtype = self.config.hidden_size, self.fc.weight.dtype
        width = features.shape[-1]
        if width not in (D, 3 * D):
            raise ValueError(f"features must be [.., {3 * D}] (target layers) or [.., {D}] (head outputs), got {width}")
        with torch.no_grad():
            emb = embed(input_ids).to(dtype)
        h = features.to(dtype)
        if width == 3 * D:
            if self.config.fc_norm:  # EAGLE-3.1: each fused layer normed on its own
                h = torch.cat([norm(g) for norm, g in zip(self.fc_norm, h.chunk(3, dim=-1), strict=True)], dim=-1)
            h = self.fc(h)
        layer = self.layers[0]
        layer.input_layernorm.embeds = emb
        try:
            out = run_layer(layer, h, position_ids, attention_mask, cache, rotary, self._rotary_kwargs)
        finally:
            layer.input_layernorm.embeds = None
        return self.norm(out) if self.config.norm_output else out  # EAGLE-3.1 feeds the post-norm state back

    def draft_logits(self, output: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` head outputs (:meth:`forward`) -> ``[..., S]`` logits over the draft vocabulary (row i scores
        target id ``draft_ids[i]``): ``lm_head(norm(o))``, soft-capped as the target's own logits are (Gemma-2).
        With ``norm_output`` the output already is ``norm(o)`` and is not normed twice."""
        normed = output if self.config.norm_output else self.norm(output)
        return softcap(project(normed, self.lm_head.weight), self.logit_softcap)

    # ---------------------------------------------------------------- files
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (published tensor names, ``d2t`` and ``t2d`` included)
        atomically (:func:`selfspec.heads.io.write_head_dir`). Never the target's embeddings. Returns the directory."""
        state = {_FILE_NAMES.get(k, k): v for k, v in self.state_dict().items()}
        fields = {
            "draft_vocab_size": self.config.draft_vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.config.target_layers)},
            "selfspec": dataclasses.asdict(self.config),
        }
        return write_layer_head(directory, self.arch_config, "eagle3", fields, {WEIGHTS_NAME: state})

    @classmethod
    def from_directory(
        cls, directory: str | Path, target: PreTrainedModel | None = None, target_fingerprint: str | None = None
    ) -> Eagle3Head:
        """Load a head saved by :meth:`save_pretrained` from a local directory, refusing anything that does not
        match exactly; ``target`` is attached after loading, ``target_fingerprint`` (if given) must be the stored
        one (``from_pretrained`` also takes a Hub repo id: :class:`~selfspec.heads.hub.HubMixin`).

        Raises:
            HeadFormatError: missing/corrupt files, unknown ``selfspec`` keys, config fields that disagree with
                it, an architecture that is not one layer, missing / unexpected / wrong-shape tensors, invalid
                ``d2t`` / ``t2d`` maps, or a head trained on another target. Nothing is half-loaded.
        """
        d = Path(directory)

        def pop_layout_fields(raw: dict[str, Any], config: Eagle3Config) -> None:
            aux = (raw.pop("eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
            draft = raw.pop("draft_vocab_size", None)
            if draft != config.draft_vocab_size or list(aux or []) != list(config.target_layers):
                raise HeadFormatError(f"{d / CONFIG_NAME}: draft_vocab_size / eagle_config disagree with 'selfspec'")

        # the target's model type is checked on attach: a Llama draft layer serves a target of any type
        config, arch = read_layer_head(
            d, "eagle3", "EAGLE-3", Eagle3Config, None, target_fingerprint, pop_fields=pop_layout_fields
        )
        inverse = {v: k for k, v in _FILE_NAMES.items()}
        state = {inverse.get(k, k): v for k, v in read_safetensors(d / WEIGHTS_NAME).items()}
        if "d2t" in state and "t2d" in state:
            check_vocab_maps(
                state["d2t"], state["t2d"], config.draft_vocab_size, config.vocab_size, str(d / WEIGHTS_NAME)
            )
        head = cls(config, arch)
        load_state(head, d / WEIGHTS_NAME, state)
        if target is not None:
            head.attach_target(target)
        return head


register_head_family(HeadFamily("eagle3", "EAGLE-3", Eagle3Head, Eagle3Head.from_directory))
