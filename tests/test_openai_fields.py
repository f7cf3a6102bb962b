"""The OpenAI fields through the official openai client against a live server on 127.0.0.1: echo, logprobs,
max_tokens 0 (scoring), n, best_of, stop, seed, penalties, logit_bias, response_format, user,
max_completion_tokens, stream_options.include_usage, context limits (docs/design.md §10).

Logprobs are checked against log_softmax of the model's own logits, computed here on the same weights."""
import json

import httpx
import openai
import pytest
import torch

from latentmoe_lab.server.loading import load_model
from latentmoe_lab.server.settings import split_service_dict
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.tokenizer import SPECIAL_TOKENS, ByteTokenizer

KEY = "fields-key"
SERVICE = {"model": {"name": "tiny-test", "preset": "tiny", "max_model_len": 128},
           "memory": {"max_num_seqs": 8, "block_size": 16, "cache_bytes": 4_000_000, "prefix_cache": {}},
           "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 32},
           "server": {"default_max_tokens": 5, "max_body_bytes": 65536}}
PROMPT = "def add(a, b):\n    return a + b\n"
TOL = 1e-5


@pytest.fixture(scope="module")
def service():
    with start_service(SERVICE, api_key=KEY) as (served, worker):
        yield served, worker


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def logp():
    """ids -> log_softmax of the model's logits [len, vocab], computed in this process on the same weights."""
    model = load_model(split_service_dict(SERVICE)[0])

    def run(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def _collect(stream):
    """Completion chunks -> {index: (text, tokens, token_logprobs, text_offset, finish_reason)}, and usage."""
    out, usage = {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text, tokens, lps, offsets, reason = out.get(c.index, ("", [], [], [], None))
            if c.logprobs is not None:
                tokens, lps = tokens + c.logprobs.tokens, lps + c.logprobs.token_logprobs
                offsets = offsets + c.logprobs.text_offset
            out[c.index] = (text + c.text, tokens, lps, offsets, c.finish_reason or reason)
    return out, usage


def test_echo_logprobs_scoring_equal_the_models_logits(client, logp):
    ids = list(PROMPT.encode())
    reference = logp(ids)
    response = client.completions.create(model="tiny-test", prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == list(PROMPT) and lp.text_offset == list(range(len(PROMPT)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = reference[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), expected, atol=TOL)
    for position, top in enumerate(lp.top_logprobs[1:]):  # the 3 most likely and the prompt's own token
        wanted = set(torch.topk(reference[position], 3).indices.tolist()) | {ids[position + 1]}
        assert {_token_id(key) for key in top} == wanted
        assert all(abs(value - float(reference[position, _token_id(key)])) < TOL for key, value in top.items())


def _token_id(token: str) -> int:
    """The inverse of the server's token strings: a character < 0x80, "bytes:\\xNN", a special name, "token_id:N"."""
    if token.startswith("bytes:"):
        return int(token[-2:], 16)
    if token.startswith("token_id:"):
        return int(token.split(":")[1])
    return SPECIAL_TOKENS.get(token, ord(token[0]))


def test_echo_and_generated_logprobs_text_and_stream(client, logp):
    ids = list(b"The cat")
    kwargs = dict(model="tiny-test", prompt=[*ids], echo=True, logprobs=2, max_tokens=6, temperature=0)
    response = client.completions.create(**kwargs)
    choice = response.choices[0]
    generated = choice.model_extra["token_ids"]
    assert len(generated) == 6 == response.usage.completion_tokens
    reference = logp(ids + generated)
    lps = choice.logprobs.token_logprobs
    assert len(lps) == len(ids) + 6 and lps[0] is None
    expected = reference[torch.arange(len(ids) + 5), torch.tensor(ids[1:] + generated)]
    assert torch.allclose(torch.tensor(lps[1:]), expected, atol=TOL)
    assert all(generated[i] == int(reference[len(ids) - 1 + i].argmax()) for i in range(6))  # greedy
    assert choice.text.startswith("The cat") and choice.logprobs.text_offset[len(ids)] == len("The cat")
    streamed, usage = _collect(client.completions.create(stream=True, stream_options={"include_usage": True},
                                                         **kwargs))
    text, tokens, stream_lps, offsets, reason = streamed[0]
    assert (text, tokens, offsets, reason) == (choice.text, choice.logprobs.tokens, choice.logprobs.text_offset,
                                               choice.finish_reason)
    assert stream_lps[0] is None and torch.allclose(torch.tensor(stream_lps[1:]), torch.tensor(lps[1:]), atol=TOL)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 6)


def test_a_list_of_prompts_as_evaluation_harnesses_send_it(client, logp):
    """prompt: [[ids], [ids]] with echo, logprobs 1, max_tokens 1 (lm-eval's loglikelihood request): one
    choice per prompt, in order, each scoring its own prompt."""
    batch = [list(b"2 + 2 ="), list(b"The sky is")]
    response = client.completions.create(model="tiny-test", prompt=batch, echo=True, logprobs=1, max_tokens=1,
                                         temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == sum(map(len, batch)) and response.usage.completion_tokens == 2
    for ids, choice in zip(batch, response.choices):
        lps = choice.logprobs.token_logprobs
        assert choice.text.startswith(bytes(ids).decode()) and len(lps) == len(ids) + 1
        expected = logp(ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor(lps[1:len(ids)]), expected, atol=TOL)
    both = client.completions.create(model="tiny-test", prompt=["a", "b"], n=2, max_tokens=2, temperature=0)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model="tiny-test", prompt=p, max_tokens=2, temperature=0).choices[0].text
             for p in ("a", "b")]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]


def test_n_seeded_samples_and_best_of(client):
    kwargs = dict(model="tiny-test", prompt="Once", max_tokens=6, temperature=1.0, seed=7)
    three = client.completions.create(n=3, logprobs=0, **kwargs)
    again = client.completions.create(n=3, logprobs=0, **kwargs)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2] and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1 and three.usage.completion_tokens == 18
    sums = [sum(c.logprobs.token_logprobs) for c in three.choices]
    best = client.completions.create(n=1, best_of=3, **kwargs)
    assert len(best.choices) == 1 and best.choices[0].text == texts[sums.index(max(sums))]
    assert best.usage.completion_tokens == 18  # every sample counts
    greedy = client.completions.create(model="tiny-test", prompt="Once", max_tokens=4, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text
    streamed, usage = _collect(client.completions.create(stream=True, n=3, stream_options={"include_usage": True},
                                                         **kwargs))
    assert [streamed[i][0] for i in range(3)] == texts and usage.completion_tokens == 18


def test_stop_strings_cut_the_text_before_the_stop(client):
    kwargs = dict(model="tiny-test", prompt="abc", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[3:5]
    expected = full[:full.find(stop)]
    for stream in (False, True):
        if stream:
            text, _, _, _, reason = _collect(client.completions.create(stop=[stop, "\x00never"], stream=True,
                                                                       **kwargs))[0][0]
        else:
            choice = client.completions.create(stop=[stop, "\x00never"], **kwargs).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert (text, reason) == (expected, "stop")


def test_chat_fields(client):
    messages = [{"role": "user", "content": "hi"}]
    kwargs = dict(model="tiny-test", messages=messages, temperature=0, seed=3, user="u1", presence_penalty=0.0,
                  frequency_penalty=0.0, response_format={"type": "text"})
    response = client.chat.completions.create(max_completion_tokens=4, logprobs=True, top_logprobs=2, n=2, **kwargs)
    assert len(response.choices) == 2 and response.usage.completion_tokens == 8
    content = response.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=TOL) for entry in content)  # greedy
    chunks = list(client.chat.completions.create(max_completion_tokens=4, stream=True, logprobs=True, top_logprobs=2,
                                                 stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == response.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    full = response.choices[0].message.content
    stop = full[1:3]
    cut = client.chat.completions.create(max_completion_tokens=4, stop=stop, **kwargs).choices[0]
    assert (cut.message.content, cut.finish_reason) == (full[:full.find(stop)], "stop")
    indices = {c.choices[0].index for c in client.chat.completions.create(max_tokens=2, n=3, stream=True, **kwargs)
               if c.choices}
    assert indices == {0, 1, 2}
    default = client.chat.completions.create(**kwargs)  # no limit given: server.default_max_tokens (5)
    assert default.usage.completion_tokens == 5 and default.choices[0].finish_reason == "length"


def test_penalties_and_logit_bias_change_the_choice(client):
    kwargs = dict(model="tiny-test", prompt="aaaa", max_tokens=8, temperature=0)
    forced = client.completions.create(logit_bias={"120": 100}, **kwargs).choices[0]
    assert forced.model_extra["token_ids"] == [120] * 8 and forced.text == "x" * 8
    plain = client.completions.create(logit_bias={"120": 10}, **kwargs).choices[0].model_extra["token_ids"]
    penalized = client.completions.create(logit_bias={"120": 10}, frequency_penalty=2.0, presence_penalty=2.0,
                                          **kwargs).choices[0].model_extra["token_ids"]
    assert plain == [120] * 8 and penalized != plain  # a repeated token pays 4 per use after the first
    greedy = client.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    for tiny in (1e-40, 5e-324):  # below the greedy floor: no division overflowing to NaN, no failed step
        assert client.completions.create(**{**kwargs, "temperature": tiny}).choices[0].model_extra["token_ids"] == greedy


def test_context_limit_names_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-test", prompt="x" * 100, max_tokens=40)
    message = info.value.body["message"]
    assert info.value.body["param"] == "max_tokens" and "100" in message and "40" in message and "128" in message
    room = client.completions.create(model="tiny-test", prompt="x" * 125, temperature=0)  # default 5, room 3
    assert room.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-test", prompt="x", stop=["a" * 10_000])
    assert info.value.body["param"] == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-test", prompt="x", suffix="y")
    assert info.value.body["param"] == "suffix"


def test_disconnect_during_n_samples_frees_every_sequence(service):
    served, worker = service
    body = {"model": "tiny-test", "prompt": "go", "max_tokens": 100, "n": 4, "stream": True, "temperature": 1}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        seen = set()
        for line in response.iter_lines():  # until every sample has sent a token: all four run
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 4:
                break
        assert seen == {0, 1, 2, 3} and worker.last_stats["blocks_used"] > 0
    _wait_idle(served.url)


def _wait_idle(url, timeout=30):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health").json()
        if health["running"] == health["waiting"] == health["blocks_used"] == health["slots_used"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle after {timeout} s: {health}")


def _greedy_cut_at(logp, prompt_ids, stop_at):
    """A plain in-process greedy generation, cut as the public servers cut at a stop string: the stop is
    text[stop_at:stop_at + 2]; -> (stop, text before it, ids up to and including the one completing it, their
    logprobs)."""
    ids, vocab = [], 0
    for _ in range(stop_at + 4):
        last = logp(prompt_ids + ids)[-1]
        ids, vocab = ids + [int(last.argmax())], len(last)
    decode = ByteTokenizer(vocab).decode
    stop = decode(ids)[stop_at:stop_at + 2]
    assert "\ufffd" not in stop  # an unfinished character decodes as U+FFFD in a prefix, never in a stream
    count = next(k for k in range(1, len(ids) + 1) if stop in decode(ids[:k]))
    kept = ids[:count]
    assert len(decode(kept)) == count  # one character per token here: the text offsets are 0..count-1
    reference = logp(prompt_ids + kept)[len(prompt_ids) - 1:]
    return stop, decode(kept)[:decode(kept).find(stop)], kept, reference[torch.arange(count), torch.tensor(kept)]


def _completion_choices(response, stream: bool):
    """A completion (or its stream) -> ({index: (text, token_ids, tokens, text_offset, reason)}, {index:
    token_logprobs}, completion_tokens)."""
    out, lps, usage = {}, {}, None
    for chunk in (response if stream else [response]):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text, ids, tokens, offsets, reason = out.get(c.index, ("", [], [], [], None))
            lp = c.logprobs or openai.types.completion_choice.Logprobs(tokens=[], token_logprobs=[], text_offset=[])
            lps[c.index] = lps.get(c.index, []) + lp.token_logprobs
            out[c.index] = (text + c.text, ids + c.model_extra["token_ids"], tokens + lp.tokens,
                            offsets + lp.text_offset, c.finish_reason or reason)
    return out, lps, usage.completion_tokens


def _chat_choices(response, stream: bool):
    """A chat completion (or its stream) -> ({index: (content, token_ids, tokens, reason)}, {index: logprobs},
    completion_tokens)."""
    out, lps, usage = {}, {}, None
    for chunk in (response if stream else [response]):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text, ids, tokens, reason = out.get(c.index, ("", [], [], None))
            content = (c.delta if stream else c.message).content or ""
            entries = c.logprobs.content if c.logprobs is not None else []
            lps[c.index] = lps.get(c.index, []) + [e.logprob for e in entries]
            out[c.index] = (text + content, ids + c.model_extra["token_ids"], tokens + [e.token for e in entries],
                            c.finish_reason or reason)
    return out, lps, usage.completion_tokens


def test_stop_usage_and_token_lists_do_not_depend_on_step_timing(client, logp):
    """A greedy stop early in a long max_tokens: the engine makes tokens past the stop before the abort lands,
    how many depends on timing. Alone, streamed or not, n = 3, and among concurrent requests sharing steps,
    usage and every per-token list are those of an in-process greedy run cut at the stop token."""
    from concurrent.futures import ThreadPoolExecutor

    from latentmoe_lab.server.choices import token_string
    from latentmoe_lab.server.protocol import render_chat

    messages = [{"role": "user", "content": "hi"}]
    cases = {}
    for kind, prompt_ids in (("completion", list(b"Once")), ("chat", list(render_chat(messages).encode()))):
        stop, text, kept, reference = _greedy_cut_at(logp, prompt_ids, 3)
        tokens = [token_string(t) for t in kept]
        common = dict(model="tiny-test", temperature=0, max_tokens=48, stop=[stop, "\x00never"])
        if kind == "completion":
            cases[kind] = (dict(prompt="Once", logprobs=2, **common), (text, kept, tokens, list(range(len(kept)))))
        else:
            cases[kind] = (dict(messages=messages, logprobs=True, top_logprobs=2, **common), (text, kept, tokens))
        cases[kind] += (reference,)

    def ask(kind: str, stream: bool, n: int):
        kwargs, expected, reference = cases[kind]
        usage = {"stream_options": {"include_usage": True}} if stream else {}
        create = client.completions.create if kind == "completion" else client.chat.completions.create
        read = _completion_choices if kind == "completion" else _chat_choices
        choices, lps, completion_tokens = read(create(stream=stream, n=n, **usage, **kwargs), stream)
        assert completion_tokens == n * len(expected[1]), (kind, stream, n)
        for index in range(n):
            assert choices[index] == (*expected, "stop"), (kind, stream, n)
            assert torch.allclose(torch.tensor(lps[index]), reference, atol=TOL), (kind, stream, n)

    for shape in (("completion", False, 1), ("completion", True, 3), ("chat", True, 1), ("chat", False, 3)):
        ask(*shape)  # alone: each abort lands while the engine steps this request only
    shapes = [(kind, stream, n) for kind in cases for stream in (False, True) for n in (1, 3)]
    noise = dict(model="tiny-test", prompt="zz", max_tokens=24, temperature=1.0, seed=1)
    with ThreadPoolExecutor(len(shapes) + 1) as pool:  # together: steps shared, the event loop busy
        busy = pool.submit(client.completions.create, **noise)
        for future in [pool.submit(ask, *shape) for shape in shapes]:
            future.result()
        assert busy.result().usage.completion_tokens == 24
