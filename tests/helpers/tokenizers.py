"""Tokenizers built in place (no download)."""

from __future__ import annotations

V = 96  # the vocabulary of the tiny targets (tests/helpers/archs.py)


def byte_level_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style) trained on a line of ASCII: non-ASCII characters stay bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<pad>", "<s>", "</s>"]
    )
    tok.train_from_iterator(["hello world, the cat sat on the mat, euro"] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class CharTokenizer:
    """Character-level stand-in for a chat tokenizer over the tiny model's 96 ids.

    Ids 0, 1, 2 are pad, BOS and EOS; ids 3..95 are the printable characters ' '..'|', so ``decode`` then
    re-encoding gives back the same ids (a later turn contains the earlier answer's ids verbatim).
    """

    eos_token_id = 2

    def encode_text(self, text: str) -> list[int]:
        return [ord(c) - 29 if 32 <= ord(c) <= 124 else ord("?") - 29 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=False, return_dict=False):
        ids = [1]
        for m in messages:
            ids += self.encode_text(f"<{m['role']}>") + self.encode_text(m["content"]) + [2]
        if add_generation_prompt:
            ids += self.encode_text("<assistant>")
        return {"input_ids": ids} if return_dict else ids

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i + 29) if i >= 3 else ("" if skip_special_tokens else f"[{i}]") for i in ids)


WORDS = (
    "the a one two three sea moon bread river music winter train mountain is was and of to in it blue "
    "wide cold warm old new tell me about please thing good day night light dark song long short fast slow "
    "here there what why how yes no we you they green red white black small big"
).split()


def tiny_tokenizer(words: tuple[str, ...] | list[str] = tuple(WORDS)):
    """A word-level fast tokenizer over 7 special tokens and ``words``, with a chat template (ids < 96, the tiny
    targets' vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
    vocab = {w: i for i, w in enumerate(specials + list(words))}
    assert len(vocab) <= V
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=specials[4:],
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return fast
