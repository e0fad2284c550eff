"""What the recipes that train on the target's features share: EAGLE-1 and EAGLE-3
(:class:`~selfspec.train.eagle_data.PairRecipe`), DFlash and DSpark (:class:`~selfspec.train.dflash.BlockRecipe`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from selfspec.train.feature_store import FeatureStore
from selfspec.train.loop import Recipe, draft_vocabulary
from selfspec.train.online_features import is_online

if TYPE_CHECKING:
    from selfspec.train.inputs import RunInputs


class FeatureRecipe(Recipe):
    """A recipe on a training and a held-out :class:`~selfspec.train.feature_store.FeatureStore`: batches of whole
    rows of up to ``max_length`` tokens, ``batch_tokens // max_length`` rows per optimiser step; the draft vocabulary
    chosen from the answer tokens; the target's frozen lm_head (whole, and its rows of the draft vocabulary on the
    training device); the held-out chain history.

    Args:
        run: the run's inputs (config, target, tokenizer, held-out conversations).
        train, held: the training and held-out stores.
        signature: of the features (:func:`~selfspec.train.feature_store.feature_signature`).
        batch_tokens: tokens per optimiser step (the family's option).

    Attributes:
        recomputes_layers: the recipe honours ``activation_checkpointing`` (DFlash, DSpark); one that does not
            refuses it.

    Raises:
        ValueError: no answer token in the training data (empty data, or every answer truncated away), or
            ``activation_checkpointing`` for a recipe that does not recompute its layers.
    """

    recomputes_layers = False

    def __init__(
        self, run: RunInputs, train: FeatureStore, held: FeatureStore, signature: str, batch_tokens: int
    ) -> None:
        if run.cfg.activation_checkpointing and not self.recomputes_layers:
            raise ValueError(
                f"activation_checkpointing recomputes DFlash and DSpark draft layers; {run.cfg.head} heads train "
                "without it (their training-time test grows one KV cache through its steps): drop the option"
            )
        self.cfg, self.target, self.tokenizer, self.signature = run.cfg, run.target, run.tokenizer, signature
        self.eval_convs = run.eval_convs
        self.train, self.held = train, held
        self.answer_counts = torch.bincount(train.tokens[train.loss_mask], minlength=run.target.config.vocab_size)
        if int(self.answer_counts.sum()) == 0:
            raise ValueError("no training positions: check the data source and max_length")
        self.rows_per_step = max(1, batch_tokens // run.cfg.max_length)
        self.lm_full = run.target.get_output_embeddings().weight.detach()  # [V, D], frozen
        self._lm_rows: torch.Tensor | None = None

    def draft_ids(self) -> torch.Tensor | None:
        """The draft vocabulary: :func:`~selfspec.train.loop.draft_vocabulary` of the answer tokens' counts and
        ``cfg.draft_vocab_size`` (Long ``[S]``; None: the full vocabulary)."""
        return draft_vocabulary(self.answer_counts, self.cfg.draft_vocab_size)

    def lm_rows(self, draft_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The target's lm_head rows of the draft vocabulary ``draft_ids`` (Long ``[S]``, target ids), float32
        ``[S, D]`` on ``device``; taken once (the lm_head is frozen)."""
        if self._lm_rows is None:
            self._lm_rows = self.lm_full[draft_ids.to(self.lm_full.device)].float().to(device)
        return self._lm_rows

    def feature_summary(self) -> dict[str, Any]:
        """Where the features came from, for the summary: ``feature_source`` (``"store"`` or ``"online"``) and,
        online, ``online_feature_tokens`` (the tokens the target forwarded for both splits)."""
        if not is_online(self.train):
            return {"feature_source": "store"}
        tokens = sum(s.rows.computed_tokens for s in (self.train, self.held) if is_online(s))  # type: ignore[attr-defined]
        return {"feature_source": "online", "online_feature_tokens": tokens}

    def history(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The held-out top-1, chain acceptance and chain tau of :meth:`evaluate`'s metrics."""
        return {
            "heldout_top1": metrics["top1"],
            "heldout_chain": metrics["chain"],
            "heldout_chain_tau": metrics["chain_tau"],
        }
