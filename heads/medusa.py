"""Medusa-1 draft heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv:2401.10774).

K heads sit on the target's last hidden state ``h_t`` (after the final norm). Head k (0-based) is
``L`` residual blocks ``x + SiLU(W x + b)`` (W zero-initialised, so a fresh head reproduces ``h_t``)
followed by a vocabulary projection, and predicts the token ``k + 2`` positions ahead of ``t`` (the
target's own lm_head predicts ``t + 1``).

The projection is either an own lm_head per head, initialised from the target's (``own_lm_head=True``,
Medusa's default), or the target's frozen lm_head shared by every head. Both can be restricted to a
reduced draft vocabulary (the S most frequent target tokens, as in FR-Spec / EAGLE-3): row ``i`` of
the projection scores target token ``draft_ids[i]``.

Parameter names follow vLLM's ``MedusaModel`` (``blocks.{k}.layers.{l}.weight``,
``lm_heads.{k}.weight``) so a head directory exports without renaming.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from selfspec.heads.config import check_family_fields, config_from_dict
from selfspec.heads.families import HeadFamily, register_head_family
from selfspec.heads.hub import HubMixin
from selfspec.heads.io import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadFormatError,
    check_draft_ids,
    check_fingerprint,
    load_state,
    read_config,
    read_safetensors,
    write_head_dir,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "MedusaConfig", "MedusaHeads", "ResBlock"]


@dataclass(frozen=True)
class MedusaConfig:
    """Shape and provenance of a set of Medusa heads.

    Attributes:
        hidden_size: D, the target's hidden size.
        vocab_size: V, the target's vocabulary size.
        num_heads: K, number of heads (head k predicts token t+2+k).
        num_layers: residual blocks per head.
        own_lm_head: True: each head has its own projection (initialised from the target's lm_head);
            False: heads share the target's frozen lm_head.
        draft_vocab_size: S rows in the projection; equals ``vocab_size`` when no reduced vocabulary is used.
        target: the target name the heads were trained on (informational).
        target_fingerprint: :func:`selfspec.base.fingerprint.target_fingerprint` of that target; checked on load.
        head_topk_accuracy: optional ``[K][k]`` held-out top-1..top-k accuracies per head, used to build
            the static tree (Medusa's greedy tree construction).
    """

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = True
    draft_vocab_size: int | None = None
    target: str = ""
    target_fingerprint: str = ""
    head_topk_accuracy: list[list[float]] | None = None
    head_type: str = "medusa"

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError("num_heads and num_layers must be >= 1")
        check_family_fields(self.head_type, "medusa", self.draft_vocab_size, self.vocab_size)

    @property
    def n_draft(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Linear):
    """``x + SiLU(W x + b)`` with W and b zero-initialised (identity at start). Shapes: ``[..., D] -> [..., D]``.

    A subclass of ``nn.Linear`` so its tensors are named ``weight`` / ``bias`` as vLLM's Medusa expects.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, hidden_size)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(super().forward(x))


class _Blocks(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MedusaHeads(nn.Module, HubMixin):
    """K Medusa heads. See the module docstring for the algorithm.

    Buffers:
        draft_ids: LongTensor ``[S]``, target token id of each projection row (``arange(V)`` when full).

    Args:
        config: the head shapes.
        target_lm_head: ``[V, D]`` target lm_head weight used to initialise own heads (copied) or, when
            ``own_lm_head`` is False, referenced (never trained) at forward time.
        draft_ids: optional LongTensor ``[S]`` of target ids forming the reduced draft vocabulary.

    Raises:
        ValueError: ``draft_ids`` is not of shape ``[S]``.
    """

    def __init__(
        self,
        config: MedusaConfig,
        target_lm_head: torch.Tensor | None = None,
        draft_ids: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        D, S = config.hidden_size, config.n_draft
        if draft_ids is None:
            draft_ids = torch.arange(config.vocab_size)
        if draft_ids.shape != (S,):
            raise ValueError(f"draft_ids must have shape [{S}], got {tuple(draft_ids.shape)}")
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone(), persistent=True)
        self.blocks = nn.ModuleList(_Blocks(D, config.num_layers) for _ in range(config.num_heads))
        self.lm_heads = nn.ModuleList()
        if config.own_lm_head:
            for _ in range(config.num_heads):
                head = nn.Linear(D, S, bias=False)
                if target_lm_head is not None:
                    head.weight.data.copy_(target_lm_head.detach()[self.draft_ids].to(head.weight.dtype))
                self.lm_heads.append(head)
        self._shared: torch.Tensor | None = None
        if target_lm_head is not None:
            self.attach_target(target_lm_head)

    def attach_target(self, target_lm_head: torch.Tensor) -> None:
        """Reference the target's frozen lm_head ``[V, D]`` (needed when ``own_lm_head`` is False)."""
        if target_lm_head.shape != (self.config.vocab_size, self.config.hidden_size):
            raise HeadFormatError(
                f"target lm_head has shape {tuple(target_lm_head.shape)}, heads expect "
                f"[{self.config.vocab_size}, {self.config.hidden_size}]: these heads belong to another target."
            )
        if not self.config.own_lm_head:
            ids = self.draft_ids.to(target_lm_head.device)
            full = ids.numel() == target_lm_head.shape[0]
            self._shared = target_lm_head.detach() if full else target_lm_head.detach()[ids]

    def head_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """Residual blocks of every head. ``hidden``: ``[..., D]`` -> ``[K, ..., D]``."""
        return torch.stack([blocks(hidden) for blocks in self.blocks])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of every head over the draft vocabulary.

        Args:
            hidden: ``[..., D]`` target last hidden states (after the final norm), any float dtype.

        Returns:
            ``[K, ..., S]`` logits; head k at position t scores the token at t+2+k. Map a draft index
            ``i`` to a target token id with ``draft_ids[i]``.

        Raises:
            RuntimeError: shared-lm_head heads used before :meth:`attach_target`.
        """
        return self.state_logits(self.head_states(hidden))

    def state_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft logits of the first K' heads' states (:meth:`head_states`, cut to the heads a tree uses).

        Args:
            states: ``[K', ..., D]``, row k from head k.

        Returns:
            ``[K', ..., S]`` logits over the draft vocabulary, from each head's own lm_head or the target's shared
            one (the draft vocabulary's rows of it).

        Raises:
            RuntimeError: shared-lm_head heads used before :meth:`attach_target`.
        """
        if self.config.own_lm_head:
            return torch.stack([self.lm_heads[k](states[k]) for k in range(states.shape[0])])
        if self._shared is None:
            raise RuntimeError("heads with own_lm_head=False need attach_target(target_lm_head) first")
        return states @ self._shared.to(states.dtype).T

    # ---------------------------------------------------------------- files
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (head weights only, never target weights), atomically
        (:func:`selfspec.heads.io.write_head_dir`: other files of an existing directory are kept).

        Returns:
            The directory.
        """
        cfg = dataclasses.asdict(self.config)
        cfg.update({"model_type": "medusa", "num_hidden_layers": self.config.num_layers})
        write_head_dir(directory, cfg, {WEIGHTS_NAME: self.state_dict()}, metadata={"head_type": "medusa"})
        return Path(directory)

    @classmethod
    def from_directory(
        cls, directory: str | Path, target_lm_head: torch.Tensor | None = None, target_fingerprint: str | None = None
    ) -> MedusaHeads:
        """Load heads saved by :meth:`save_pretrained` from a local directory, refusing anything that does not
        match exactly (``from_pretrained`` also takes a Hub repo id: :class:`~selfspec.heads.hub.HubMixin`).

        Args:
            directory: the head directory.
            target_lm_head: ``[V, D]`` target lm_head, attached after loading.
            target_fingerprint: if given, must equal the fingerprint stored with the heads.

        Raises:
            HeadFormatError: missing/corrupt files, unknown config keys, missing or unexpected tensors,
                wrong shapes, invalid ``draft_ids``, or heads trained on another target. Nothing is
                half-loaded: the module is only returned when every tensor matched.
        """
        d = Path(directory)
        raw = read_config(d)
        raw.pop("model_type", None)
        raw.pop("num_hidden_layers", None)
        config = config_from_dict(MedusaConfig, raw, where=str(d / CONFIG_NAME))
        check_fingerprint(d, config.target_fingerprint, target_fingerprint, config.target)
        state = read_safetensors(d / WEIGHTS_NAME)
        draft_ids = state.get("draft_ids")
        if draft_ids is not None and draft_ids.shape == (config.n_draft,):
            check_draft_ids(draft_ids, config.n_draft, config.vocab_size, str(d / WEIGHTS_NAME))
        else:  # a placeholder: load_state reports a missing or wrong-shape draft_ids with every other mismatch
            draft_ids = torch.arange(config.n_draft)
        heads = cls(config, draft_ids=draft_ids)
        load_state(heads, d / WEIGHTS_NAME, state)
        if target_lm_head is not None:
            heads.attach_target(target_lm_head)
        return heads


def load_medusa(directory: Path, target: PreTrainedModel | None, target_fingerprint: str | None) -> MedusaHeads:
    """The Medusa family's loader (:class:`~selfspec.heads.families.HeadFamily`): :meth:`MedusaHeads.from_directory`
    with ``target``'s lm_head attached when a target is given."""
    lm_head = target.get_output_embeddings().weight if target is not None else None
    return MedusaHeads.from_directory(directory, target_lm_head=lm_head, target_fingerprint=target_fingerprint)


register_head_family(HeadFamily("medusa", "Medusa-1", MedusaHeads, load_medusa))
