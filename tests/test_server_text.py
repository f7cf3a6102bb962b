"""Streaming text pieces: the incremental detokenizer equals ByteTokenizer.decode, stop strings cut the text
before the first stop however it is chunked, and the chat template (docs/design.md §10)."""
import random

import pytest

from latentmoe_lab.server.detokenizer import IncrementalDetokenizer
from latentmoe_lab.server.errors import APIError
from latentmoe_lab.server.protocol import parse_request, render_chat
from latentmoe_lab.server.stops import StopMatcher
from latentmoe_lab.tokenizer import ByteTokenizer


def _pieces(ids, rng):
    detok, out, i = IncrementalDetokenizer(), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(detok.feed(ids[i:i + n]))
        i += n
    return "".join(out) + detok.flush()


@pytest.mark.parametrize("seed", range(20))
def test_incremental_detokenizer_equals_whole_decode(seed):
    rng = random.Random(seed)
    text_ids = list("héllo wörld 漢字 🙂".encode())
    ids = [rng.choice([rng.randrange(512), rng.choice(text_ids), 256, 259, 0xE6, 0x80]) for _ in range(rng.randint(0, 40))]
    assert _pieces(ids, rng) == ByteTokenizer(512).decode(ids)
    assert _pieces(text_ids, rng) == "héllo wörld 漢字 🙂"
    cut = text_ids[:-1]  # an unfinished last character -> U+FFFD, as the whole decode gives
    assert _pieces(cut, rng) == ByteTokenizer(512).decode(cut)


@pytest.mark.parametrize("seed", range(20))
def test_stop_matcher_cuts_before_the_first_stop_whatever_the_chunking(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abc") for _ in range(30))
    stops = ("bca", "cc")
    expected = min((text[:text.find(s)] for s in stops if s in text), key=len, default=text)
    matcher, out, i = StopMatcher(stops), [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        out.append(matcher.feed(text[i:i + n]))
        i += n
    out.append(matcher.flush())
    assert "".join(out) == expected
    assert matcher.stopped == (expected != text)


def test_chat_template_is_byte_exact_and_parsed_requests_use_it():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]) == \
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    parsed = parse_request({"model": "m", "messages": messages, "temperature": 0, "max_tokens": 3}, "chat", "m", 512, 64)
    assert bytes(parsed.prompt_ids).decode() == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert parsed.params.max_tokens == 3 and parsed.params.greedy and not parsed.stream
    with pytest.raises(APIError) as info:
        parse_request({"model": "m", "messages": [{"role": "user", "content": "x" * 70}]}, "chat", "m", 512, 64)
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
