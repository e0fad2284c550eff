"""A head family defined entirely in the tests: the proof that a family is its own files plus its registrations.

``toy``: one linear map from the target's last hidden state (after the final norm) ``h_t`` to the logits of token
``x_{t+2}`` (Medusa's first head without its residual block, over the target's full vocabulary). It drafts a tree of
the root and its ``width`` best candidates, trains on the target's own features through the one training loop, is
saved and loaded by the strict head I/O with the target's fingerprint, and has no export layout.

Importing this module registers the family in each layer's registry: the head (:mod:`selfspec.heads.families`), the
recipe (:mod:`selfspec.train.recipes`) and the drafter and card (:mod:`selfspec.families`). Nothing outside this file
names it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfspec.base.fingerprint import target_fingerprint
from selfspec.card_text import CardContext, CardText
from selfspec.decode.drafters.base import AcceptedPath, Drafter, DrafterInfo, DraftLimit
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree
from selfspec.families import Family, register_family
from selfspec.head_drafters import DraftSetup
from selfspec.heads.config import config_from_dict
from selfspec.heads.families import HeadFamily, register_head_family
from selfspec.heads.hub import HubMixin
from selfspec.heads.io import WEIGHTS_NAME, check_fingerprint, load_state, read_config, read_safetensors, write_head_dir
from selfspec.train.feature_store import target_features
from selfspec.train.inputs import RunInputs
from selfspec.train.loop import Recipe, StepLoss, train_loop
from selfspec.train.losses import IGNORE
from selfspec.train.medusa import position_table
from selfspec.train.recipes import RecipeEntry, capture_last_state, register_recipe

TOY = "toy"


@dataclass(frozen=True)
class ToyConfig:
    """The toy head's shape and the target it drafts for."""

    hidden_size: int
    vocab_size: int
    width: int = 2
    head_type: str = TOY
    target: str = ""
    target_fingerprint: str = ""


class ToyHead(nn.Module, HubMixin):
    """``logits(x_{t+2}) = W h_t``, ``W`` ``[V, D]`` float32."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` -> ``[..., V]``."""
        return self.proj(hidden)

    def save_pretrained(self, directory: str | Path) -> Path:
        """``config.json`` and ``model.safetensors`` through the strict writer."""
        write_head_dir(directory, dataclasses.asdict(self.config), {WEIGHTS_NAME: self.state_dict()})
        return Path(directory)

    @classmethod
    def from_directory(cls, directory: Path, target: Any = None, fingerprint: str | None = None) -> ToyHead:
        """The strict reader: every key of the config, every tensor and its shape, the checksum, the target."""
        d = Path(directory)
        config = config_from_dict(ToyConfig, read_config(d), where=str(d / "config.json"))
        check_fingerprint(d, config.target_fingerprint, fingerprint, config.target)
        head = cls(config)
        load_state(head, d / WEIGHTS_NAME, read_safetensors(d / WEIGHTS_NAME))
        return head


class ToyDrafter(Drafter):
    """The root and the head's ``width`` best candidates for the token after it (deterministic top-k)."""

    def __init__(self, head: ToyHead) -> None:
        self.head = head
        self._hidden: torch.Tensor | None = None

    def info(self) -> DrafterInfo:
        return DrafterInfo(name=TOY, max_depth=1, vocab_size=self.head.config.vocab_size, head=True)

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        self._hidden = hidden[-1]

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        cand = self.head(self._hidden.to(self.head.proj.weight.dtype)).topk(self.head.config.width).indices
        tokens = torch.cat([context[-1:], cand.to(context.device)])
        parents = torch.tensor([-1] + [0] * cand.numel(), device=context.device)
        return DraftTree(tokens=tokens, parents=parents)

    def accept(self, accepted: AcceptedPath) -> None:
        self._hidden = accepted.hidden[-1]


def make_toy_drafter(setup: DraftSetup, **options: Any) -> tuple[ToyDrafter, None]:
    """The family's drafter factory (a fixed tree: nothing to size)."""
    return ToyDrafter(setup.head), None


class ToyRecipe(Recipe):
    """Cross entropy of the head against ``x_{t+2}`` on the target's last hidden states (Medusa's first head)."""

    family = TOY

    def __init__(self, run: RunInputs) -> None:
        train, held, self.signature = target_features(run)
        self.cfg, self.target = run.cfg, run.target
        self.hidden, labels, _ = position_table(train, 1)
        self.labels = labels[:, 0]
        held_hidden, held_labels, _ = position_table(held, 1)
        self.held = (held_hidden.float(), held_labels[:, 0])
        cfg = ToyConfig(
            run.target.config.hidden_size,
            run.target.config.vocab_size,
            target=run.cfg.target,
            target_fingerprint=target_fingerprint(run.target),
        )
        self.head = ToyHead(cfg)

    def module(self) -> nn.Module:
        return self.head

    def batches(self, epoch: int) -> list[list[int]]:
        return [list(range(self.hidden.shape[0]))]

    def collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(items, dtype=torch.long)
        return {"hidden": self.hidden[idx].float(), "labels": self.labels[idx]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        loss = nn.functional.cross_entropy(model(batch["hidden"]), batch["labels"], ignore_index=IGNORE)
        return StepLoss(loss, {}, {"train_tokens": int(batch["labels"].numel())})

    def evaluate(self) -> dict[str, Any]:
        hidden, labels = self.held
        with torch.no_grad():
            hit = self.head(hidden).argmax(-1) == labels
        scored = labels != IGNORE
        return {"top1": round(float(hit[scored].float().mean()) if scored.any() else 0.0, 4)}

    def history(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return dict(metrics)

    def acceptance(self, metrics: dict[str, Any]) -> list[float] | None:
        return [metrics["top1"]]

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        self.head.save_pretrained(head_dir)
        return dict(metrics)


def train_toy(run: RunInputs) -> Path:
    """The family's recipe: :class:`ToyRecipe` on the one training loop."""
    return train_loop(run.cfg, run.accelerator, ToyRecipe(run), run.heldout())


def toy_description(ours: Mapping[str, Any]) -> str:
    return f"One linear map from the target's last hidden state to its {ours.get('vocab_size')}-token vocabulary."


def toy_engines(ctx: CardContext) -> str:
    return "### vLLM, SGLang and llama.cpp\n\nNo engine has a layout for toy heads: serve them with selfspec.\n"


register_head_family(HeadFamily(TOY, "Toy", ToyHead, ToyHead.from_directory))
register_recipe(TOY, RecipeEntry(train_toy, capture_last_state))
register_family(Family(TOY, make_toy_drafter, card=CardText("none (a test family)", toy_description, toy_engines)))
