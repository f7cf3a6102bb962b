"""Streaming text pieces: the incremental detokenizer equals ByteTokenizer.decode, stop strings cut the text
before the first stop however it is chunked, and the chat template (docs/design.md §10)."""
import random

import pytest

from latentmoe_lab.server.choices import ChoiceText, token_bytes
from latentmoe_lab.server.detokenizer import IncrementalDetokenizer
from latentmoe_lab.server.errors import APIError
from latentmoe_lab.server.protocol import parse_request, render_chat
from latentmoe_lab.server.stops import StopMatcher
from latentmoe_lab.serving.logprobs import TokenLogprob
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


@pytest.mark.parametrize("seed", range(10))
def test_chat_logprob_bytes_reassemble_the_text_for_every_id(seed):
    """The `bytes` of a chat logprobs entry are the bytes its token adds to the content: ids past the byte
    vocabulary and the specials (which decode as '?') included, so the entries' bytes rebuild the text."""
    rng = random.Random(seed)
    ids = [rng.choice([rng.randrange(512), rng.randrange(261, 512), 256, 260, 0xE6, 0x80, 0x41])
           for _ in range(rng.randint(1, 40))]
    rebuilt = b"".join(bytes(token_bytes(token_id)) for token_id in ids)  # the entries' "bytes"
    assert rebuilt.decode("utf-8", errors="replace") == ByteTokenizer(512).decode(ids)


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


@pytest.mark.parametrize("seed", range(12))
def test_a_choice_ends_at_the_token_that_completes_its_stop_however_the_ids_arrive(seed):
    """Ids in events of 1-4 (as steps and a late abort deliver them): the text is cut before the stop, the
    tokens and the count end at the token that completed it (those inside the stop kept, later ones dropped),
    the cumulative logprob is over those; the same as a whole decode of the ids cut there."""
    rng = random.Random(seed)
    ids = [rng.choice([*b"abx", 0xC3, 0xA9, 300, 256]) for _ in range(40)]
    stops, decode = ("ab", "\u00e9x"), ByteTokenizer(512).decode  # 2 tokens each; 3 bytes with the C3 A9 of e-acute
    count = next((k for k in range(1, len(ids) + 1) if any(s in decode(ids[:k]) for s in stops)), len(ids))
    whole = decode(ids[:count])
    expected = whole[:min([whole.find(s) for s in stops if s in whole], default=len(whole))]
    choice, text, tokens, i = ChoiceText(stops), "", [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        released = choice.feed(ids[i:i + n], [TokenLogprob(t, -1.0 - t) for t in ids[i:i + n]])
        text, tokens, i = text + released.text, tokens + released.tokens, i + n
    released = choice.finish()
    text, tokens = text + released.text, tokens + released.tokens
    assert (text, [t for t, _, _ in tokens], choice.kept) == (expected, ids[:count], count)
    assert [lp.token_id for _, lp, _ in tokens] == ids[:count]
    assert choice.cumulative_logprob == sum(-1.0 - t for t in ids[:count])
    assert [offset for _, _, offset in tokens] == sorted(offset for _, _, offset in tokens)


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
