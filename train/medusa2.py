"""Medusa-2 recipe (Cai et al. 2024, arXiv:2401.10774, section 2.3.2): Medusa heads trained jointly with a LoRA
adapter (Hu et al. 2021, arXiv:2106.09685) on the target, on the shared loop.

Medusa-1 trains heads on the frozen target's last hidden states; Medusa-2 lets the target's own layers adapt
so their hidden states serve the heads better, and keeps the adapted target's predictions close to the base's
with self-distillation. At every batch of whole sequences (right-padded):

* the adapted target (base + LoRA, ``peft``) runs forward with gradients, giving ``h`` ``[B, T, D]`` after the
  final norm and its distribution ``q_t = softmax(lm_head(h_t))``;
* the frozen base (the same model with the adapter disabled, ``PeftModel.disable_adapter``) runs forward
  without gradients, giving ``p_t``;
* loss ``= heads_weight * L_heads(h) + kl_weight * mean_t KL(p_t || q_t)``, with ``L_heads`` Medusa-1's loss
  (:func:`~selfspec.train.losses.medusa_loss`; head k at position t predicts ``x_{t+2+k}``, scored where that
  token is an assistant token) and the KL at positions t whose next token ``x_{t+1}`` is an assistant token.
  The heads' gradient flows into the adapter: that is what makes it joint.

The LoRA ``B`` matrices start at zero, so the adapted target starts equal to the base (the KL starts at 0).
The loop's module holds only what is trained (the adapter's parameters and the heads), so checkpoints are small
and a killed run resumes exactly; the base weights are the frozen target's own. The heads directory holds the
heads and ``adapter/`` (``PeftModel.save_pretrained``); the heads' fingerprint names base and adapter, and
``selfspec.load(base, heads_dir)`` merges that adapter into the target (:mod:`selfspec.base.adapter`), so decoding is
exactly the adapted target's greedy / sampled output.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import LoraConfig, get_peft_model

from selfspec.base.fingerprint import target_fingerprint
from selfspec.decode.kv import backbone
from selfspec.heads.eagle import softcap
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.train.config import TrainConfig
from selfspec.train.feature_store import feature_signature, training_examples
from selfspec.train.inputs import RunInputs
from selfspec.train.loop import Recipe, StepLoss, train_loop
from selfspec.train.losses import IGNORE, medusa_loss, topk_hits
from selfspec.train.medusa import head_labels, label_vocabulary, to_draft_labels
from selfspec.train.warm_start import copy_head, init_head

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
"""The adapter's directory inside a Medusa-2 heads directory."""


class JointMedusa(torch.nn.Module):
    """The module Medusa-2 trains: the adapter's parameters (registered here, shared with the adapted model's
    LoRA layers) and the heads; the adapted model itself is held unregistered, so ``state_dict`` is what is
    trained and nothing else.

    Args:
        adapted: the ``PeftModel`` (base + LoRA) on the training device.
        heads: the Medusa heads.
        logit_softcap: the target's ``final_logit_softcapping`` (None for most targets).
    """

    def __init__(self, adapted: PeftModel, heads: MedusaHeads, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.__dict__["adapted"] = adapted  # not a submodule: its frozen base is not ours to save
        self.lora = torch.nn.ParameterList([p for _, p in adapted.named_parameters() if p.requires_grad])
        self.heads = heads
        self.logit_softcap = logit_softcap

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = backbone(self.adapted.get_base_model())(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lm = self.adapted.get_base_model().get_output_embeddings()
        return softcap(lm(hidden).float(), self.logit_softcap)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, kl_at: torch.Tensor, heads_at: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step's forward.

        Args:
            input_ids / attention_mask: ``[B, T]`` (right padding, mask 0 on it).
            kl_at / heads_at: Bool ``[B, T]``, the positions of the KL term and of the heads' loss.

        Returns:
            ``(log_q [P1, V], log_p [P1, V], head_logits [K, P2, S])``: the adapted and the base target's
            log-distributions (float32; ``log_p`` without a graph) and the heads' logits.
        """
        hidden = self._hidden(input_ids, attention_mask)
        log_q = torch.log_softmax(self._logits(hidden[kl_at]), dim=-1)
        with torch.no_grad(), self.adapted.disable_adapter():
            base = self._hidden(input_ids, attention_mask)
            log_p = torch.log_softmax(self._logits(base[kl_at]), dim=-1)
        return log_q, log_p, self.heads(hidden[heads_at])


def collate_sequences(examples: list[dict], items: list[int], num_heads: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of whole sequences: ``input_ids`` / ``attention_mask`` ``[B, T]``, ``kl_at`` Bool
    ``[B, T]`` (t with ``x_{t+1}`` an assistant token), ``heads_at`` Bool ``[B, T]`` (t where some head has a
    label) and ``labels`` ``[P2, K]`` (target ids, ``-100`` where unscored) at ``heads_at`` in row-major order."""
    seqs = [examples[i] for i in items]
    T = max(int(e["input_ids"].numel()) for e in seqs)
    B = len(seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    kl_at = torch.zeros(B, T, dtype=torch.bool)
    labels = torch.full((B, T, num_heads), IGNORE, dtype=torch.long)
    for b, e in enumerate(seqs):
        x, m = e["input_ids"], e["loss_mask"].bool()
        n = x.numel()
        ids[b, :n], attn[b, :n] = x, 1
        kl_at[b, : n - 1] = m[1:]
        labels[b, :n] = head_labels(x, m, num_heads)
    heads_at = (labels != IGNORE).any(-1)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "kl_at": kl_at,
        "heads_at": heads_at,
        "labels": labels[heads_at],
    }


class Medusa2Recipe(Recipe):
    """Medusa-2: heads and a LoRA adapter trained jointly (module docstring); ``cfg.medusa`` holds the options.

    Raises:
        ValueError: no training position; the adapter cannot wrap the target (``peft``'s message, with the fix:
            set ``medusa.lora_modules``).
    """

    family = "medusa"

    def __init__(
        self,
        cfg: TrainConfig,
        target: PreTrainedModel,
        train: list[dict],
        held: list[dict],
        signature: str,
    ) -> None:
        self.cfg, self.target, self.signature = cfg, target, signature
        opts = cfg.medusa
        self.train_examples = [e for e in train if e["input_ids"].numel() >= 3]
        self.held_examples = [e for e in held if e["input_ids"].numel() >= 3]
        labels = [head_labels(e["input_ids"], e["loss_mask"].bool(), opts.num_heads) for e in self.train_examples]
        all_labels = torch.cat(labels) if labels else torch.empty(0, opts.num_heads, dtype=torch.long)
        if not bool((all_labels != IGNORE).any()):
            raise ValueError("no training positions: check the data source and max_length")
        V = target.config.vocab_size
        warm = init_head(cfg, target)  # Medusa-1 heads: Medusa-2's first stage
        draft_ids, self.t2d, n_draft = label_vocabulary(all_labels, cfg.draft_vocab_size, V, warm)
        torch.manual_seed(cfg.seed)
        lora = LoraConfig(
            r=opts.lora_rank,
            lora_alpha=opts.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(opts.lora_modules) if opts.lora_modules else None,
            task_type="CAUSAL_LM",
        )
        base = copy.deepcopy(target)  # the caller's target stays the bare base
        base.requires_grad_(False)
        try:
            self.adapted = get_peft_model(base, lora)
        except ValueError as e:
            raise ValueError(
                f"cannot put a LoRA adapter on this target ({e}); name its linear layers with "
                "medusa.lora_modules, e.g. [q_proj, v_proj]"
            ) from e
        mcfg = MedusaConfig(
            hidden_size=target.config.hidden_size,
            vocab_size=V,
            num_heads=opts.num_heads,
            num_layers=opts.num_layers,
            own_lm_head=True,
            draft_vocab_size=n_draft if n_draft < V else None,
            target=cfg.target,
            target_fingerprint=target_fingerprint(self.adapted),
        )
        lm_head = target.get_output_embeddings().weight.detach().float().cpu().clone()
        self.heads = MedusaHeads(mcfg, target_lm_head=lm_head, draft_ids=draft_ids).to(target.device)
        copy_head(self.heads, warm)
        self.joint = JointMedusa(self.adapted, self.heads, getattr(target.config, "final_logit_softcapping", None))

    def module(self) -> torch.nn.Module:
        return self.joint

    def batches(self, epoch: int) -> list[list[int]]:
        """Sequences shuffled by ``seed`` and epoch, grouped in order so that each batch's padded size
        (sequences x longest) stays within ``medusa.batch_tokens``."""
        g = torch.Generator().manual_seed(self.epoch_seed(epoch))
        order = torch.randperm(len(self.train_examples), generator=g).tolist()
        out: list[list[int]] = []
        longest = 0
        for i in order:
            n = int(self.train_examples[i]["input_ids"].numel())
            if out and max(longest, n) * (len(out[-1]) + 1) <= self.cfg.medusa.batch_tokens:
                out[-1].append(i)
                longest = max(longest, n)
            else:
                out.append([i])
                longest = n
        return out

    def collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        batch = collate_sequences(self.train_examples, items, self.cfg.medusa.num_heads)
        batch["labels"] = self._draft_labels(batch["labels"])
        return batch

    def _draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        out = to_draft_labels(labels, self.t2d)
        return out.masked_fill(out == -1, IGNORE)  # out-of-vocabulary tokens: no gradient

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        opts = self.cfg.medusa
        b = batch
        log_q, log_p, head_logits = model(b["input_ids"], b["attention_mask"], b["kl_at"], b["heads_at"])
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean() if log_q.shape[0] else log_q.sum() * 0.0
        heads_loss, per_head = medusa_loss(head_logits, batch["labels"], opts.head_decay)
        loss = opts.heads_weight * heads_loss + opts.kl_weight * kl
        return StepLoss(
            loss,
            {"kl_to_base": round(float(kl.detach()), 5), "per_head_loss": [round(float(x), 4) for x in per_head]},
            {"train_tokens": int(batch["attention_mask"].sum())},
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out: each head's cumulative top-1..top-k accuracy on the adapted target's hidden states
        (``topk``), the mean ``KL(p_base || p_adapted)`` and the share of positions where the adapted target's
        greedy token is the base's (``base_top1_agreement``), at the KL positions."""
        joint, k, K = self.joint, self.cfg.eval_topk, self.cfg.medusa.num_heads
        was_training = joint.training
        joint.eval()
        hits = torch.zeros(K, k, dtype=torch.long)
        counts = torch.zeros(K, dtype=torch.long)
        kl_sum, agree, n_kl = 0.0, 0, 0
        dev = self.target.device
        for s in range(0, len(self.held_examples), 4):
            b = collate_sequences(self.held_examples, list(range(s, min(s + 4, len(self.held_examples)))), K)
            b = {name: v.to(dev) for name, v in b.items()}
            log_q, log_p, head_logits = joint(b["input_ids"], b["attention_mask"], b["kl_at"], b["heads_at"])
            kl_sum += float((log_p.exp() * (log_p - log_q)).sum(-1).sum())
            agree += int((log_q.argmax(-1) == log_p.argmax(-1)).sum())
            n_kl += log_q.shape[0]
            h, c = topk_hits(head_logits, to_draft_labels(b["labels"], self.t2d.to(dev)), k)
            hits += h.cpu()
            counts += c.cpu()
        joint.train(was_training)
        topk = [[round(float(hits[h, j]) / max(1, int(counts[h])), 4) for j in range(k)] for h in range(K)]
        return {
            "topk": topk,
            "kl_to_base": round(kl_sum / max(1, n_kl), 5),
            "base_top1_agreement": round(agree / max(1, n_kl), 4),
        }

    def history(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {
            "top1": [a[0] for a in metrics["topk"]],
            "heldout_kl_to_base": metrics["kl_to_base"],
            "base_top1_agreement": metrics["base_top1_agreement"],
        }

    def acceptance(self, metrics: dict[str, Any]) -> list[float] | None:
        # head k's held-out top-1 stands for the acceptance at depth k + 1 (teacher-forced: an estimate)
        return [a[0] for a in metrics["topk"]]

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        """The heads (fingerprinted as base + this adapter) and ``adapter/`` beside them."""
        self.heads.config = dataclasses.replace(
            self.heads.config, head_topk_accuracy=metrics["topk"], target_fingerprint=target_fingerprint(self.adapted)
        )
        self.heads.save_pretrained(head_dir)
        self.adapted.save_pretrained(str(Path(head_dir) / ADAPTER_DIR))
        return {
            "heldout_topk_accuracy": metrics["topk"],
            "heldout_kl_to_base": metrics["kl_to_base"],
            "base_top1_agreement": metrics["base_top1_agreement"],
            "adapter": ADAPTER_DIR,
            "joint": True,
        }


def train_medusa2(run: RunInputs) -> Path:
    """Train Medusa-2 heads and their LoRA adapter on ``run.target`` (left unchanged: a copy is adapted); returns
    the heads directory (``<output_dir>/heads``, with ``adapter/``). Self-distillation's captured features are not
    used: the target changes as it trains.

    Raises:
        ValueError: no training positions; an adapter that cannot wrap the target.
    """
    cfg, target = run.cfg, run.target
    train = training_examples(cfg, target, run.tokenizer, run.train_convs)
    held = training_examples(cfg, target, run.tokenizer, run.eval_convs)
    opts = cfg.medusa
    what = f"medusa2:r{opts.lora_rank}:a{opts.lora_alpha}:{','.join(opts.lora_modules or ())}"
    if cfg.init_heads:
        what += f":init={cfg.init_heads}"
    signature = feature_signature(target, run.train_convs, run.eval_convs, cfg.max_length, what)
    recipe = Medusa2Recipe(cfg, target, train, held, signature)
    return train_loop(cfg, run.accelerator, recipe, run.heldout())
