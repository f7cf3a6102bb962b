"""A tiny random kimi_linear checkpoint with a tokenizer of its own, for the served-tokenizer tests: a byte-level
BPE trained here (vocabulary VOCAB = the model's), written as tokenizer.json, and optionally a tokenizer_config.json
with a jinja chat template, as a transformers checkpoint ships them (docs/design.md §17.6).
"""
from __future__ import annotations

import json

import torch

from interop_cases import kimi_config, randomize
from latentmoe_lab.tokenizer import FileTokenizer

VOCAB = 320  # 256 byte tokens, the control tokens, merges
TEXTS = ["the cat sat on the mat", "héllo wörld, 漢字 and 🙂 emoji", "naïve café über straße",
         "def add(a, b):\n    return a + b\n", "system user assistant: be brief"]
CONTROL_TOKENS = ["<|bos|>", "<|im_start|>", "<|im_end|>"]
# a ChatML-like template: the variables transformers passes (messages, add_generation_prompt, bos_token), a loop,
# a condition, a filter, and raise_exception for a conversation it refuses
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' and loop.first %}"
    "{{ raise_exception('the conversation must not begin with an assistant message') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_bpe(directory) -> FileTokenizer:
    """A byte-level BPE trained on TEXTS with CONTROL_TOKENS as special tokens, saved as directory/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=CONTROL_TOKENS)
    tokenizer.train_from_iterator(TEXTS * 3, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return FileTokenizer(directory / "tokenizer.json", tokenizer.get_vocab_size())


def save_bpe_checkpoint(directory, chat_template: str | None = None) -> FileTokenizer:
    """A random kimi_linear checkpoint (vocabulary VOCAB) saved by transformers into `directory`, with its own
    tokenizer.json and, given `chat_template`, a tokenizer_config.json carrying it (bos / eos declared)."""
    from transformers import KimiLinearForCausalLM

    config = kimi_config("kda-mla-kda")
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    randomize(KimiLinearForCausalLM(config), seed=3).eval().save_pretrained(directory)
    tokenizer = train_bpe(directory)
    if chat_template is not None:
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|im_end|>",
                    "chat_template": chat_template}
        (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    return tokenizer
