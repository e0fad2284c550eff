"""Parallel block drafters: DFlash (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv:2602.06036) and DSpark (DeepSeek 2026, arXiv:2607.05147: DFlash plus a low-rank Markov head and a confidence
head), drafted by :class:`selfspec.decode.drafters.block.BlockDrafter`.

One draft forward predicts a whole block. The head is a few Qwen3-style decoder layers (q/k norms, SwiGLU MLP,
RoPE; :mod:`selfspec.heads.block_layers`), whatever the target's architecture, sized like the target's layers so
that the target's token embedding and lm_head are shared (frozen, never saved). With ``n`` tokens decided and the
last of them (the anchor ``x_n``, at position ``n``) not yet seen by the target::

    g_t      = hidden_norm(fc(concat_i h_t^(i)))                 # t < n: the target's states after layers
                                                                 #   target_layer_ids, fused: [.., k D] -> [.., D]
    K_ctx, V_ctx (layer l) = k_norm(k_proj_l(g_t)) (RoPE at t), v_proj_l(g_t)   # the context, cached
    e_j      = embed(x_n) for j = 0, embed(mask_token_id) for j = 1 .. B - 1    # the block, positions n + j
    layer l: a = input_layernorm(e); Q, K, V from a (q/k norms, RoPE at n + j);
             e = e + o_proj(attention(Q, [K_ctx; K], [V_ctx; V]))   # bidirectional in the block, all context
             e = e + mlp(post_attention_layernorm(e))
    z_j      = norm(e_j);   logits_j = lm_head(z_j)              # the target's lm_head, or the head's own rows of a
                                                                 #   reduced draft vocabulary (d2t as EAGLE-3's)

DFlash: slot ``j`` (1 .. B-1) predicts ``x_{n+j}``: B - 1 drafts. DSpark (the anchor-first layout llama.cpp's
``DSparkDraftModel`` reads, ``sample_from_anchor``): slot ``j`` (0 .. B-1) predicts ``x_{n+1+j}``: B drafts, and two
small heads act on each slot's ``z_j`` and the token before it (``prev_j``: the anchor for the first slot, then the
previous slot's draft, chained through the block; the true previous token in training)::

    logits_j += markov_w2(markov_w1[prev_j])                     # low-rank Markov bias, rank R
    conf_j    = sigmoid(proj(concat(z_j, markov_w1[prev_j])))     # the chance that slot j survives verification

Tensor names are those of the published DFlash / DSpark checkpoints that llama.cpp's converter maps
(``fc``, ``hidden_norm``, ``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``norm``, ``lm_head`` + ``d2t`` / ``t2d`` only with a reduced
vocabulary, ``markov_head.markov_w{1,2}.weight``, ``confidence_head.proj.{weight,bias}``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from selfspec.base.cpu_linear import project
from selfspec.heads.block_layers import BlockLayer
from selfspec.heads.config import check_family_fields, check_layer_ids, read_selfspec_config
from selfspec.heads.eagle import logit_softcap, softcap
from selfspec.heads.eagle3 import check_vocab_maps, vocab_maps
from selfspec.heads.families import HeadFamily, register_head_family
from selfspec.heads.hub import HubMixin
from selfspec.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadFormatError,
    load_state,
    read_config,
    read_safetensors,
    write_head_dir,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["BLOCK_HEAD_TYPES", "SIBLING_TOP_K", "BlockConfig", "BlockHead", "default_target_layer_ids"]

BLOCK_HEAD_TYPES = ("dflash", "dspark")
# candidates per slot whose held-out acceptance is measured (BlockConfig.heldout_siblings): the widest tree the
# block drafter is sized to
SIBLING_TOP_K = 4
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}


def default_target_layer_ids(num_target_layers: int, count: int = 3) -> tuple[int, ...]:
    """DFlash's choice of target layers (outputs of layers ``target_layer_ids``): ``count`` layers spread evenly
    from layer 1 to layer ``L - 3`` (as the reference ``build_target_layer_ids``), clamped into ``[0, L - 2]`` so the
    state is never the last layer's (which ``transformers`` returns after the final norm). SmolLM2-135M (L = 30):
    ``(1, 14, 27)``.

    Raises:
        ValueError: fewer than 2 target layers, or ``count < 1``.
    """
    if num_target_layers < 2 or count < 1:
        raise ValueError(
            f"a block drafter needs a target of >= 2 layers and >= 1 layer to fuse, got {num_target_layers}"
        )
    top = num_target_layers - 2
    if count == 1:
        return (min(num_target_layers // 2, top),)
    start, end = 1, max(1, num_target_layers - 3)
    ids = [round(start + i * (end - start) / (count - 1)) for i in range(count)]
    return tuple(min(max(i, 0), top) for i in ids)


@dataclass(frozen=True)
class BlockConfig:
    """selfspec's own fields of a DFlash or DSpark head (the layers' sizes live in its Qwen3 config).

    Attributes:
        head_type: ``"dflash"`` or ``"dspark"``.
        hidden_size: D, the target's hidden size (the head's too: embeddings and lm_head are shared).
        vocab_size: V, the target's vocabulary size.
        num_target_layers: L, the target's decoder layers (checked on attach).
        block_size: B, the block's slots including the anchor (DFlash drafts B - 1 tokens, DSpark B).
        num_layers: the head's decoder layers (1 .. 8).
        target_layer_ids: the target layers whose *outputs* are fused (DFlash's convention: ``hidden_states[i + 1]``
            of ``transformers``), each in ``[0, L - 2]``; default :func:`default_target_layer_ids`.
        mask_token_id: the target id whose (frozen) embedding marks the block's slots to predict.
        draft_vocab_size: S, the head's own lm_head rows (``d2t``); S = V shares the target's lm_head.
        markov_rank: R of the DSpark Markov head (0 for DFlash).
        confidence: whether a DSpark confidence head is present.
        target, target_fingerprint: the target trained on (informational) and its fingerprint (checked on load).
        heldout_top1: held-out agreement of the first draft with the target's greedy token, if measured.
        heldout_chain: held-out greedy chain acceptance by depth (``[d - 1]``: the share of blocks whose first d
            drafts the target accepts), from which decoding sizes the block to the machine; None if not measured.
        heldout_siblings: ``[k - 2][d - 1]`` for k = 2 .. :data:`SIBLING_TOP_K`: the held-out share of blocks whose
            first d - 1 drafts are accepted, whose d-th is not, and whose d-th target token is among the slot's next
            k - 1 candidates (what a tree of ``top_k = k`` adds to tau at depth d); None if not measured.

    Raises:
        HeadFormatError: another head type, or fields out of range.
    """

    head_type: str
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    block_size: int
    num_layers: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...] | None = None
    draft_vocab_size: int | None = None
    markov_rank: int = 0
    confidence: bool = False
    target: str = ""
    target_fingerprint: str = ""
    heldout_top1: float | None = None
    heldout_chain: tuple[float, ...] | None = None
    heldout_siblings: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        check_family_fields(self.head_type, BLOCK_HEAD_TYPES, self.draft_vocab_size or None, self.vocab_size)
        layers = self.target_layer_ids
        layers = default_target_layer_ids(self.num_target_layers) if layers is None else layers
        layers = check_layer_ids("target_layer_ids", layers, 0, self.num_target_layers - 2)  # layer outputs
        object.__setattr__(self, "target_layer_ids", layers)
        object.__setattr__(self, "draft_vocab_size", self.draft_vocab_size or self.vocab_size)
        problems = []
        if not 2 <= self.block_size <= 64:
            problems.append(f"block_size {self.block_size} must be in [2, 64]")
        if not 1 <= self.num_layers <= 8:
            problems.append(f"num_layers {self.num_layers} must be in [1, 8]")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if (self.head_type == "dspark") != (self.markov_rank > 0) or (self.confidence and self.markov_rank == 0):
            problems.append("a dspark head has a Markov head (markov_rank > 0); a dflash head has neither of its heads")
        if problems:
            raise HeadFormatError("; ".join(problems))

    @property
    def anchor_first(self) -> bool:
        """DSpark's layout: slot 0 (the anchor) predicts the next token; DFlash predicts in place from slot 1."""
        return self.head_type == "dspark"

    @property
    def first_slot(self) -> int:
        """The first block slot that predicts a token (0 for DSpark, 1 for DFlash)."""
        return 0 if self.anchor_first else 1

    @property
    def max_drafts(self) -> int:
        """Draft tokens per block: B for DSpark, B - 1 for DFlash."""
        return self.block_size - self.first_slot

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The same layers in the loop's convention (``hidden_states[i]``, the input of layer i): ``id + 1``."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def n_draft(self) -> int:
        """S, the draft vocabulary size."""
        return int(self.draft_vocab_size)

    @property
    def cost_shape(self) -> str:
        """The sizes one head forward's cost depends on besides the target, as a file-name part of the draft-cost
        cache (:mod:`selfspec.decode.tuning.draft_costs`): the block, the draft layers, the draft vocabulary and the
        Markov rank."""
        return f"b{self.block_size}-l{self.num_layers}-v{self.n_draft}-r{self.markov_rank}"


class MarkovHead(nn.Module):
    """DSpark's low-rank Markov bias: ``markov_w2(markov_w1[prev]) [.., S]`` for previous target ids ``prev``."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # an untrained Markov head adds nothing

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``prev`` Long ``[..]`` -> ``(bias [.., S], code [.., R])`` (the code also feeds the confidence head)."""
        code = self.markov_w1(prev)
        return project(code, self.markov_w2.weight), code


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: ``sigmoid(proj(concat(z, code)))``, the chance a slot survives verification."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, z: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """``z [.., D]`` normed slot states, ``code [.., R]`` -> logits ``[..]`` (apply a sigmoid for the chance)."""
        return self.proj(torch.cat([z, code.to(z.dtype)], dim=-1)).squeeze(-1)


class BlockHead(nn.Module, HubMixin):
    """A DFlash or DSpark head (see the module docstring for the computation and the tensor names).

    Args:
        config: :class:`BlockConfig`.
        layer_config: the layers' Qwen3 config (:func:`~selfspec.heads.block_layers.draft_layer_config` of the
            target's config).
        draft_ids: LongTensor ``[S]`` of strictly ascending target ids when S < V (default ``arange(S)``).
        target: the frozen target; attached when given (its embedding, lm_head and logit soft-capping are shared).

    Raises:
        HeadFormatError: the layer config disagrees with ``config``, or the vocabulary maps are invalid.
    """

    def __init__(
        self,
        config: BlockConfig,
        layer_config: Qwen3Config,
        draft_ids: torch.Tensor | None = None,
        target: PreTrainedModel | None = None,
    ) -> None:
        super().__init__()
        D, V, S = config.hidden_size, config.vocab_size, config.n_draft
        if (layer_config.hidden_size, layer_config.vocab_size, layer_config.num_hidden_layers) != (
            D,
            V,
            config.num_layers,
        ):
            raise HeadFormatError("the layer config's hidden size, vocabulary or layer count disagrees with the head's")
        self.config, self.layer_config = config, layer_config
        self.fc = nn.Linear(len(config.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = Qwen3RMSNorm(D, eps=layer_config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(layer_config) for _ in range(config.num_layers))
        self.norm = Qwen3RMSNorm(D, eps=layer_config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(layer_config)
        self.lm_head: nn.Linear | None = None
        if S < V:
            d2t, t2d = vocab_maps(torch.arange(S) if draft_ids is None else draft_ids, V)
            self.register_buffer("d2t", d2t)
            self.register_buffer("t2d", t2d)
            self.lm_head = nn.Linear(D, S, bias=False)
        self.markov_head = MarkovHead(V, S, config.markov_rank) if config.markov_rank else None
        self.confidence_head = ConfidenceHead(D, config.markov_rank) if config.confidence else None
        self._target: tuple[nn.Module, nn.Module] | None = None  # (embedding, lm_head): the target's, never saved
        self.logit_softcap: float | None = None
        if target is not None:
            self.attach_target(target)
            if self.lm_head is not None:
                with torch.no_grad():
                    self.lm_head.weight.copy_(target.get_output_embeddings().weight[self.draft_ids])

    # ---------------------------------------------------------------- target
    @property
    def draft_ids(self) -> torch.Tensor:
        """LongTensor ``[S]``: the target id of each draft id (``arange(S) + d2t``; ``arange(V)`` for the full one)."""
        if self.lm_head is None:
            return torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target states the head takes, in the loop's ``hidden_states[i]`` convention (:class:`BlockConfig`)."""
        return self.config.target_layers

    def attach_target(self, target: PreTrainedModel) -> None:
        """Reference the frozen target's token embedding and lm_head (never registered or saved) and keep its
        ``final_logit_softcapping``.

        Raises:
            HeadFormatError: the target's hidden size, vocabulary or layer count differ from the head's.
        """
        cfg = target.config
        want = (self.config.hidden_size, self.config.vocab_size, self.config.num_target_layers)
        if (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers) != want:
            raise HeadFormatError(
                f"target has hidden {cfg.hidden_size} / vocab {cfg.vocab_size} / {cfg.num_hidden_layers} layers, the "
                f"{self.config.head_type} head expects {want[0]} / {want[1]} / {want[2]}: it belongs to another target"
            )
        self._target = (target.get_input_embeddings(), target.get_output_embeddings())
        self.logit_softcap = logit_softcap(cfg)

    @property
    def has_target(self) -> bool:
        """Whether :meth:`attach_target` has run: the target's embedding and lm_head are referenced."""
        return self._target is not None

    def target_modules(self) -> tuple[nn.Module, nn.Module]:
        """The attached target's ``(token embedding, lm_head)`` modules, frozen and shared (never saved).

        Raises:
            RuntimeError: no target attached (:meth:`attach_target`).
        """
        if self._target is None:
            raise RuntimeError(f"{type(self).__name__} needs attach_target(target) (its embeddings and lm_head) first")
        return self._target

    # ---------------------------------------------------------------- compute
    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """``[B, T, k D]`` the target's states at ``target_layer_ids`` (concatenated in that order) -> ``[B, T, D]``
        ``hidden_norm(fc(states))`` in the head's dtype."""
        return self.hidden_norm(project(states.to(self.fc.weight.dtype), self.fc.weight))

    def _cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, positions)

    def context(self, states: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context keys and values for the target's states ``[B, T, k D]`` at ``positions`` Long
        ``[B, T]``: per layer ``(K, V)`` ``[B, Hkv, T, hd]`` (K normed and rotated at ``positions``)."""
        g = self.fuse(states)
        cos, sin = self._cos_sin(g, positions)
        return [layer.self_attn.keys_values(g, cos, sin) for layer in self.layers]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's normed states.

        Args:
            tokens: Long ``[B, Q]`` target ids (anchors and ``mask_token_id``).
            positions: Long ``[B, Q]`` their positions.
            context: :meth:`context` of the states they attend to (``C`` positions).
            mask: additive float ``[B or 1, 1, Q, C + Q]`` (0 attend, dtype-min blocked), or None: every context
                position and every block slot visible (one block at decode time).

        Returns:
            ``z`` ``[B, Q, D]`` (after the final norm): :meth:`draft_logits` scores it; DSpark's heads read it too.

        Raises:
            RuntimeError: no target attached.
        """
        embed, _ = self.target_modules()
        with torch.no_grad():
            x = embed(tokens).to(self.fc.weight.dtype)
        cos, sin = self._cos_sin(x, positions)
        for layer, ctx in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, ctx, mask)
        return self.norm(x)

    def draft_logits(self, z: torch.Tensor) -> torch.Tensor:
        """``[.., D]`` normed slot states -> ``[.., S]`` logits over the draft vocabulary (row i scores target id
        ``draft_ids[i]``), soft-capped as the target's own logits are (Gemma-2); without the Markov bias."""
        weight = self.lm_head.weight if self.lm_head is not None else self.target_modules()[1].weight
        return softcap(project(z, weight.to(z.dtype)), self.logit_softcap)

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """DSpark's ``(bias [.., S], code [.., R])`` for previous target ids ``prev`` Long ``[..]``; None for DFlash."""
        return None if self.markov_head is None else self.markov_head(prev)

    def confidence_logits(self, z: torch.Tensor, code: torch.Tensor) -> torch.Tensor | None:
        """DSpark's confidence logits ``[..]`` (``sigmoid`` gives the survival chance); None without the head."""
        return None if self.confidence_head is None else self.confidence_head(z, code)

    # ---------------------------------------------------------------- files
    def file_config(self) -> dict[str, Any]:
        """``config.json``: the layers' Qwen3 config, the layout keys llama.cpp's and the reference loaders read
        (``architectures``, ``dflash_config``, ``block_size``, ``draft_vocab_size``), ``head_type`` and ``selfspec``."""
        cfg = self.config
        raw = self.layer_config.to_dict()
        raw.pop("_attn_implementation_autoset", None)
        raw.update(
            {
                "architectures": [ARCHITECTURES[cfg.head_type]],
                "head_type": cfg.head_type,
                "block_size": cfg.block_size,
                "draft_vocab_size": cfg.n_draft,
                "dflash_config": {
                    "block_size": cfg.block_size,
                    "mask_token_id": cfg.mask_token_id,
                    "target_layer_ids": list(cfg.target_layer_ids),
                },
                "selfspec": dataclasses.asdict(cfg),
            }
        )
        if cfg.head_type == "dspark":
            raw.update({"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla", "sample_from_anchor": True})
        return raw

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` atomically (:func:`selfspec.heads.io.write_head_dir`);
        never the target's embedding or lm_head. Returns the directory."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        write_head_dir(
            directory, self.file_config(), {WEIGHTS_NAME: state}, metadata={"head_type": self.config.head_type}
        )
        return Path(directory)

    @classmethod
    def from_directory(
        cls, directory: str | Path, target: PreTrainedModel | None = None, target_fingerprint: str | None = None
    ) -> BlockHead:
        """Load a head saved by :meth:`save_pretrained`, refusing anything that does not match exactly; ``target`` is
        attached after loading, ``target_fingerprint`` (if given) must be the stored one.

        Raises:
            HeadFormatError: missing or corrupt files, a config that is not a DFlash / DSpark head or whose layout
                keys disagree with its ``selfspec`` object, missing / unexpected / wrong-shape tensors, invalid
                ``d2t`` / ``t2d``, or a head trained on another target. Nothing is half-loaded.
        """
        d = Path(directory)
        where = d / CONFIG_NAME
        raw = read_config(d)
        head_type = raw.get("head_type")
        if head_type not in BLOCK_HEAD_TYPES:
            raise HeadFormatError(
                f"{where} is not a DFlash / DSpark head (head_type must be one of {BLOCK_HEAD_TYPES})"
            )
        config = read_selfspec_config(d, raw, BlockConfig, target_fingerprint)
        try:
            layer_config = Qwen3Config(**{k: v for k, v in raw.items() if k not in _LAYOUT_KEYS})
        except (TypeError, ValueError) as err:
            raise HeadFormatError(f"{where}: not a Qwen3 layer config ({err})") from err
        head = cls(config, layer_config)
        expected = head.file_config()
        wrong = sorted(k for k in _LAYOUT_KEYS - {"selfspec", "transformers_version"} if raw.get(k) != expected.get(k))
        if wrong:
            raise HeadFormatError(f"{where}: {wrong} disagree with its 'selfspec' object; re-save the head")
        state = read_safetensors(d / WEIGHTS_NAME)
        if "d2t" in state and "t2d" in state:
            check_vocab_maps(state["d2t"], state["t2d"], config.n_draft, config.vocab_size, str(d / WEIGHTS_NAME))
        load_state(head, d / WEIGHTS_NAME, state)
        if target is not None:
            head.attach_target(target)
        return head


_LAYOUT_KEYS = frozenset(
    {
        "architectures",
        "head_type",
        "block_size",
        "draft_vocab_size",
        "dflash_config",
        "selfspec",
        "markov_rank",
        "markov_head_type",
        "sample_from_anchor",
        "model_type",
        "transformers_version",
    }
)


register_head_family(HeadFamily("dflash", "DFlash", BlockHead, BlockHead.from_directory))
register_head_family(HeadFamily("dspark", "DSpark", BlockHead, BlockHead.from_directory))
