"""The Hugging Face tokenizer files save_pretrained writes give ByteTokenizer's ids in both libraries."""
import json
import random

import pytest
import tokenizers
import transformers

from latentmoe_lab.tokenizer import SPECIAL_TOKENS, ByteTokenizer
from latentmoe_lab.tokenizer_files import TOKENIZER_FILES, byte_to_unicode, write_tokenizer_files


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """(checkpoint dir written by save_pretrained, AutoTokenizer from it, tokenizers.Tokenizer from it, ByteTokenizer)."""
    directory = model.save_pretrained(tmp_path_factory.mktemp("ckpt") / "tiny")
    return (directory, transformers.AutoTokenizer.from_pretrained(directory),
            tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")), ByteTokenizer(model.config.vocab_size))


def _random_text(rng: random.Random) -> str:
    """Text mixing ASCII, whitespace, the special-token names and 2-, 3- and 4-byte characters."""
    pieces = ["def f(x):\n", "\t", "  ", " . ", "<image>", "<image_start>", "<pad>", "é", "€", "😀", "\r\n", "\x00"]
    chars = [rng.choice(pieces) if rng.random() < 0.3 else chr(rng.choice([rng.randrange(32, 127),
                                                                             rng.randrange(0x80, 0x10FFFF)]))
             for _ in range(rng.randrange(1, 40))]
    return "".join(c for c in chars if not 0xD800 <= ord(c[0]) <= 0xDFFF) or "x"


def test_save_pretrained_writes_the_tokenizer_files(saved):
    directory, auto, raw, _ = saved
    assert all((directory / name).is_file() for name in TOKENIZER_FILES)
    assert raw.get_vocab_size() == auto.vocab_size == len(SPECIAL_TOKENS) + 256
    assert auto.pad_token_id == SPECIAL_TOKENS["<pad>"]
    # lm-eval's prefix token for perplexity and empty contexts (its BOS, else its EOS; null when neither)
    assert auto.bos_token_id == SPECIAL_TOKENS["<bos>"] and auto.eos_token is None
    assert {auto.convert_tokens_to_ids(name): name for name in SPECIAL_TOKENS} == {i: n for n, i in SPECIAL_TOKENS.items()}
    assert auto.model_max_length == json.loads((directory / "config.json").read_text())["max_position_embeddings"]
    table = byte_to_unicode()
    assert len(set(table.values())) == 256 and all(table[b] == chr(b) for b in b"azAZ09!~")


def test_text_encodes_to_the_byte_tokenizers_ids(saved):
    _, auto, raw, byte_tokenizer = saved
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng)
        expected = byte_tokenizer.encode(text)[0].tolist()
        assert raw.encode(text).ids == expected, text
        assert auto(text)["input_ids"] == expected == auto.encode(text), text
        assert auto.decode(expected) == raw.decode(expected) == text
    # the special-token names in text are bytes, as in ByteTokenizer and on the server
    assert auto.encode("<image><pad>") == raw.encode("<image><pad>").ids == list(b"<image><pad>")


def test_random_bytes_decode_like_the_byte_tokenizer(saved):
    """Any ids 0..259, invalid UTF-8 included: the same text, and ids -> tokens -> ids round-trips exactly."""
    _, auto, raw, byte_tokenizer = saved
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(256) if rng.random() < 0.9 else rng.choice(list(SPECIAL_TOKENS.values()))
               for _ in range(rng.randrange(1, 48))]
        text = byte_tokenizer.decode(ids)
        assert auto.decode(ids) == raw.decode(ids, skip_special_tokens=False) == text, ids
        assert auto.convert_tokens_to_ids(auto.convert_ids_to_tokens(ids)) == ids
        assert [raw.token_to_id(raw.id_to_token(i)) for i in ids] == ids
        if not any(i in SPECIAL_TOKENS.values() for i in ids):
            assert bytes(ids).decode("utf-8", errors="replace") == text
            assert auto.encode(text) == byte_tokenizer.encode(text)[0].tolist()


def test_the_vocabulary_holds_every_id_once(tmp_path):
    write_tokenizer_files(tmp_path, 128)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 128 and config["split_special_tokens"] is True
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256 + len(SPECIAL_TOKENS)))
