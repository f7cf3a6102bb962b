"""A checkpoint with its own tokenizer.json, served: text prompts are encoded and generated ids decoded with it,
the same object the engine's text inputs use (tokenizer.tokenizer_of), never as raw bytes (docs/design.md §10,
§17).

The unit half: the running detokenizer's pieces, however the ids arrive, concatenate to one decode of them all,
for a byte-level BPE (which splits characters over tokens: a piece never holds half of one) and a
SentencePiece-style Metaspace BPE (whose decode of a token alone drops its space: joining per-token decodes is
wrong). The service half: a tiny random kimi_linear checkpoint with a byte-level BPE trained here, through the
official openai client against a loopback uvicorn server: completions and chat, streamed and not, equal the
engine's greedy ids decoded by the tokenizer; stop strings, echo and logprobs' token strings use it too.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import openai
import pytest
import torch

from interop_cases import kimi_config, randomize
from latentmoe_lab.server.choices import ChoiceText, TokenText
from latentmoe_lab.server.detokenizer import RunningDetokenizer
from latentmoe_lab.server.protocol import render_chat
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.serving.logprobs import TokenLogprob
from latentmoe_lab.tokenizer import FileTokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["the cat sat on the mat", "héllo wörld, 漢字 and 🙂 emoji", "naïve café über straße",
         "def add(a, b):\n    return a + b\n"]
VOCAB = 320  # the byte-level BPE: 256 byte tokens, a special, merges
PROMPTS = ["héllo 漢字 🙂", "the cat sat", "def add(a, b):\n"]
NEW_TOKENS = 10


def _train(kind: str, directory) -> FileTokenizer:
    """A BPE trained on TEXTS, saved as directory/tokenizer.json; kind: 'byte_level' or 'metaspace'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "byte_level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|end|>"])
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"])
    tokenizer.train_from_iterator(TEXTS * 3, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return FileTokenizer(directory / "tokenizer.json", tokenizer.get_vocab_size())


def _pieces(detokenizer, ids: list[int], rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(detokenizer.feed(ids[i:i + n]))
        i += n
    return out + [detokenizer.flush()]


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_running_pieces_equal_one_decode_and_never_split_a_character(tmp_path, kind):
    tokenizer = _train(kind, tmp_path)
    for seed in range(12):
        rng = random.Random(seed)
        text = " ".join(rng.choice(" ".join(TEXTS).split()) for _ in range(rng.randint(1, 12)))
        ids = tokenizer.encode(text)[0].tolist()
        pieces = _pieces(RunningDetokenizer(tokenizer), ids, rng)
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)  # no piece holds part of a character
        noise = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 30))]  # any ids at all
        assert "".join(_pieces(RunningDetokenizer(tokenizer), noise, rng)) == tokenizer.decode(noise)
    ids = tokenizer.encode("héllo 漢字 🙂 the cat")[0].tolist()
    assert "".join(tokenizer.decode([i]) for i in ids) != tokenizer.decode(ids)  # why per-token decode is wrong


def test_a_choice_cuts_at_a_stop_in_the_tokenizers_text_and_names_tokens_by_it(tmp_path):
    tokenizer = _train("byte_level", tmp_path)
    texts = TokenText(tokenizer)
    ids = tokenizer.encode("héllo wörld, 漢字 and 🙂 emoji")[0].tolist()
    choice, text = ChoiceText(("字 a",), texts=texts), ""
    for token_id in ids:
        text += choice.feed([token_id], [TokenLogprob(token_id, -1.0)]).text
    text += choice.finish().text
    assert text == "héllo wörld, 漢" and choice.stopped
    alone = [tokenizer.decode([i]) for i in ids]
    assert [texts.token_string(i) for i in ids] == [t if "\ufffd" not in t else f"token_id:{i}"
                                                     for i, t in zip(ids, alone)]
    assert any(texts.token_bytes(i) is None for i in ids)  # a piece of a character: bytes null
    assert texts.encode("the cat") == tokenizer.encode("the cat")[0].tolist()
    assert TokenText().encode("é") == [0xC3, 0xA9] and TokenText().token_string(0xC3) == "bytes:\\xc3"
    small = SimpleNamespace(config=SimpleNamespace(vocab_size=97))  # no tokenizer.json, too few ids for bytes
    assert TokenText.of(small).tokenizer is None  # its ids still decode by the byte rules, as before


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random kimi_linear checkpoint saved by transformers, with its byte-level BPE tokenizer.json."""
    directory = tmp_path_factory.mktemp("kimi_bpe")
    config = kimi_config("kda-mla-kda")
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    randomize(transformers.KimiLinearForCausalLM(config), seed=3).eval().save_pretrained(directory)
    return directory, _train("byte_level", directory)


def _service(directory) -> dict:
    return {"model": {"name": "bpe-test", "checkpoint": str(directory), "max_model_len": 128},
            "memory": {"max_num_seqs": 8, "block_size": 16, "cache_bytes": 4_000_000},
            "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 32}}


@pytest.fixture(scope="module")
def served(checkpoint):
    """(openai client, a greedy reference: prompt ids -> the engine's ids, in process on the same weights,
    the tokenizer, the served worker)."""
    from latentmoe_lab.server.loading import load_model
    from latentmoe_lab.server.settings import split_service_dict
    from latentmoe_lab.serving import Engine, SamplingParams

    directory, tokenizer = checkpoint
    config, _ = split_service_dict(_service(directory))
    engine = Engine(load_model(config), config)

    def greedy(ids: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        return engine.generate([ids], params, use_tqdm=False)[0].token_ids

    with start_service(_service(directory)) as (server, worker):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)
        yield client, greedy, tokenizer, worker


def test_the_service_encodes_and_decodes_with_the_engines_tokenizer(served):
    from latentmoe_lab.tokenizer import load_tokenizer

    client, greedy, tokenizer, worker = served
    served_tokenizer = TokenText.of(worker.model).tokenizer  # the very object the engine encodes text with
    assert served_tokenizer is load_tokenizer(worker.engine.tokenizer_dir, worker.model.config.vocab_size)
    assert isinstance(served_tokenizer, FileTokenizer) and served_tokenizer.path == tokenizer.path
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)[0].tolist()
        expected = greedy(ids)
        result = client.completions.create(model="bpe-test", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        choice = result.choices[0]
        assert choice.model_extra["token_ids"] == expected and result.usage.prompt_tokens == len(ids)
        assert choice.text == tokenizer.decode(expected)
        chunks = list(client.completions.create(model="bpe-test", prompt=prompt, max_tokens=NEW_TOKENS,
                                                temperature=0, stream=True))
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == expected
        assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(expected)


def test_chat_streamed_and_not_decodes_with_the_tokenizer(served):
    client, greedy, tokenizer, _ = served
    messages = [{"role": "user", "content": "héllo 漢字"}]
    expected = greedy(tokenizer.encode(render_chat(messages))[0].tolist())
    full = client.chat.completions.create(model="bpe-test", messages=messages, max_tokens=NEW_TOKENS, temperature=0)
    assert full.choices[0].model_extra["token_ids"] == expected
    assert full.choices[0].message.content == tokenizer.decode(expected)
    chunks = list(client.chat.completions.create(model="bpe-test", messages=messages, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tokenizer.decode(expected)


def test_echo_stop_and_logprobs_use_the_tokenizers_text(served):
    client, greedy, tokenizer, _ = served
    prompt = PROMPTS[0]
    ids = tokenizer.encode(prompt)[0].tolist()
    expected = greedy(ids, 24)
    whole = tokenizer.decode(expected)
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]  # two characters from the middle of the greedy text
    cut = whole[:whole.find(stop)]
    texts = TokenText(tokenizer)
    for stream in (False, True):
        result = client.completions.create(model="bpe-test", prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                           echo=True, logprobs=2, stream=stream)
        choices = [c.choices[0] for c in result] if stream else [result.choices[0]]
        assert "".join(c.text for c in choices) == prompt + cut  # the echoed prompt decodes back to itself
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        kept = ids + [t for c in choices for t in c.model_extra["token_ids"]]
        assert tokens == [texts.token_string(t) for t in kept] and kept[len(ids):] == expected[:len(kept) - len(ids)]
    chat = client.chat.completions.create(model="bpe-test", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    for entry, token_id in zip(chat.choices[0].logprobs.content, chat.choices[0].model_extra["token_ids"]):
        assert entry.token == texts.token_string(token_id) and entry.bytes == texts.token_bytes(token_id)
