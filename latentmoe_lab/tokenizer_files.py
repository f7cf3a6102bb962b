"""The byte tokenizer (latentmoe_lab/tokenizer.py) as Hugging Face tokenizer files, written by save_pretrained.

    DIR/tokenizer.json           the `tokenizers` library's file: loads with tokenizers.Tokenizer.from_file
    DIR/tokenizer_config.json    what transformers.AutoTokenizer.from_pretrained(DIR) reads first
    DIR/special_tokens_map.json  the special tokens by role

Both libraries then give ByteTokenizer's ids: id = UTF-8 byte value for any text, ids 256..259 for the special
tokens of the image spans and padding, and 260 for "<bos>", declared as bos_token. How:

- a BPE model with the 256 bytes as its vocabulary and no merges, so every byte is one token;
- a ByteLevel pre-tokenizer, which turns each UTF-8 byte into one printable character (the GPT-2 table,
  `byte_to_unicode`), and the ByteLevel decoder, which turns them back into bytes and then text (invalid UTF-8
  as U+FFFD, as ByteTokenizer.decode does);
- the special tokens are vocabulary entries of the model, not "added tokens": BPE without merges can never
  produce them from text, so the text "<image>" encodes as its 7 bytes in both libraries, as it does in
  ByteTokenizer.encode and on the server (the multimodal processor, not the tokenizer, turns image markers
  into spans). transformers makes every declared special token matchable in text, hence
  `split_special_tokens: true` in tokenizer_config.json;
- no normalizer and no post-processor (no BOS / EOS are added), and no clean-up of spaces on decode;
- bos_token "<bos>" (id 260): lm-eval scores a loglikelihood with an empty context, and every window of a
  loglikelihood_rolling (perplexity) task, after the tokenizer's BOS (else its EOS) token, and sends null when
  the files declare neither. The model never trained on it (training sees bytes only), so the first token of
  a document is scored after an untrained embedding row; lm-eval's `custom_prefix_token_id=10` scores it after
  "\n", the byte every training document follows, instead. No eos_token is declared: lm-eval would add its
  text to every generate_until request's stop strings, and the model ends no text with it.

Ids from 261 up to the model's vocab_size (padding of the embedding table) are outside these files;
ByteTokenizer decodes them as '?'.

The JSON is written by hand, so saving a checkpoint needs neither library (both are in the dev extra).
"""
from __future__ import annotations

import json
from pathlib import Path

from latentmoe_lab.tokenizer import BOS_TOKEN_ID, NUM_BYTES, PAD_TOKEN_ID, SPECIAL_TOKENS

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE)

_BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
_PAD_NAME = next(name for name, token_id in SPECIAL_TOKENS.items() if token_id == PAD_TOKEN_ID)
_BOS_NAME = next(name for name, token_id in SPECIAL_TOKENS.items() if token_id == BOS_TOKEN_ID)
_IMAGE_NAMES = [name for name in SPECIAL_TOKENS if name not in (_PAD_NAME, _BOS_NAME)]


def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte table the ByteLevel pre-tokenizer applies: byte -> one printable character.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 (controls,
    space, soft hyphen, ...) take the code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for byte in range(NUM_BYTES):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(NUM_BYTES + shifted)
            shifted += 1
    return table


def tokenizer_json() -> dict:
    """The tokenizers-library file as a dict: BPE over the 256 byte characters (+ the specials), no merges."""
    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    vocab.update(SPECIAL_TOKENS)
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **_BYTE_LEVEL}, "post_processor": None,
        "decoder": {"type": "ByteLevel", **_BYTE_LEVEL},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def special_tokens_map() -> dict:
    return {"bos_token": _BOS_NAME, "pad_token": _PAD_NAME, "additional_special_tokens": list(_IMAGE_NAMES)}


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json; model_max_length: the model's max_position_embeddings."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
            "split_special_tokens": True, "clean_up_tokenization_spaces": False,
            "add_bos_token": False, "add_eos_token": False, **special_tokens_map()}


def write_tokenizer_files(directory: str | Path, model_max_length: int) -> None:
    """Write the three files of the module docstring into `directory` (which must exist)."""
    directory = Path(directory)
    contents = {TOKENIZER_FILE: tokenizer_json(), TOKENIZER_CONFIG_FILE: tokenizer_config(model_max_length),
                SPECIAL_TOKENS_MAP_FILE: special_tokens_map()}
    for name, content in contents.items():
        (directory / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n")
