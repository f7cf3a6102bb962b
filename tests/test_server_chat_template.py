"""A checkpoint that ships a chat template is served with it (docs/design.md §17.6): the chat prompt is rendered by
the checkpoint's template through transformers and encoded by its tokenizer.json, so the prompt ids the engine gets
equal transformers' AutoTokenizer.from_pretrained(DIR).apply_chat_template(messages, tokenize=True,
add_generation_prompt=True). A template that refuses the messages (raise_exception) or cannot render is a 400
naming `messages`; our own checkpoints and a checkpoint without a template keep the plain template.
"""
from __future__ import annotations

import json
from contextlib import contextmanager

import openai
import pytest

from latentmoe_lab.server.chat_template import chat_template_of
from latentmoe_lab.server.choices import TokenText
from latentmoe_lab.server.errors import APIError
from latentmoe_lab.server.protocol import parse_request, render_chat
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.tokenizer import ByteTokenizer
from tokenizer_cases import CHAT_TEMPLATE, VOCAB, save_bpe_checkpoint, train_bpe

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CONVERSATIONS = [
    [{"role": "user", "content": "héllo 漢字"}],
    [{"role": "system", "content": "  be brief "}, {"role": "user", "content": "the cat sat"},
     {"role": "assistant", "content": "on the mat"}, {"role": "user", "content": "def add(a, b):\n"}],
]
OTHER_TEMPLATE = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}{% endfor %}>>"
NEW_TOKENS = 8


def _theirs(directory, messages: list[dict]) -> list[int]:
    """transformers' ids for the chat: what a user of the checkpoint compares against."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def _parsed_ids(texts: TokenText, messages: list[dict]) -> list[int]:
    body = {"model": "m", "messages": messages, "max_tokens": 1}
    return parse_request(body, "chat", "m", VOCAB, 512, 16, texts.encode, texts.chat_template).prompt_ids


LAYOUTS = {  # where transformers finds a template: tokenizer_config.json (a string or named ones), chat_template.jinja
    "config string": lambda d: _config(d, CHAT_TEMPLATE),
    "config named list": lambda d: _config(d, [{"name": "default", "template": CHAT_TEMPLATE},
                                               {"name": "other", "template": OTHER_TEMPLATE}]),
    "jinja file wins": lambda d: (_config(d, OTHER_TEMPLATE), (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)),
}


def _config(directory, template) -> None:
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|im_end|>",
                "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parsed_chat_ids_equal_transformers_apply_chat_template(tmp_path, layout):
    tokenizer = train_bpe(tmp_path)
    LAYOUTS[layout](tmp_path)
    texts = TokenText(tokenizer, chat_template_of(tokenizer))
    assert texts.chat_template is not None
    for messages in CONVERSATIONS:
        assert _parsed_ids(texts, messages) == _theirs(tmp_path, messages)
    parts = [{"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "漢字"}]}]
    assert _parsed_ids(texts, parts) == _theirs(tmp_path, CONVERSATIONS[0])  # text parts join as one content


def test_without_a_template_the_plain_one_renders(tmp_path):
    tokenizer = train_bpe(tmp_path)  # a tokenizer.json and no template anywhere
    assert chat_template_of(tokenizer) is None and chat_template_of(ByteTokenizer(512)) is None
    texts = TokenText(tokenizer, None)
    assert _parsed_ids(texts, CONVERSATIONS[0]) == tokenizer.encode(render_chat(CONVERSATIONS[0]))[0].tolist()


def test_a_template_that_cannot_render_is_a_400_naming_messages(tmp_path):
    tokenizer = train_bpe(tmp_path)
    _config(tmp_path, "{% for m in messages %}{{ m.content }{% endfor %}")  # a jinja syntax error
    texts = TokenText(tokenizer, chat_template_of(tokenizer))
    with pytest.raises(APIError) as info:
        _parsed_ids(texts, CONVERSATIONS[0])
    assert info.value.status == 400 and info.value.param == "messages" and info.value.code == "chat_template_error"
    assert "messages: the checkpoint's chat template" in info.value.message


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(openai client, the checkpoint directory, greedy: prompt ids -> the engine's ids on the same weights, the
    prompt ids the served worker was given)."""
    from latentmoe_lab.server.loading import load_model
    from latentmoe_lab.server.settings import split_service_dict
    from latentmoe_lab.serving import Engine, SamplingParams

    directory = tmp_path_factory.mktemp("kimi_chat")
    tokenizer = save_bpe_checkpoint(directory, CHAT_TEMPLATE)
    service = {"model": {"name": "chat-test", "checkpoint": str(directory), "max_model_len": 128},
               "memory": {"max_num_seqs": 8, "block_size": 16, "cache_bytes": 4_000_000},
               "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 32}}
    config, _ = split_service_dict(service)
    engine = Engine(load_model(config), config)

    def greedy(ids: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
        return engine.generate([ids], params, use_tqdm=False)[0].token_ids

    with start_service(service) as (server, worker):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=60)
        yield client, directory, tokenizer, greedy, worker


@contextmanager
def _submitted(worker):
    """The prompt ids of each request the app submits to the worker (an engine-side record)."""
    seen, submit = [], worker.submit

    def recording(prompt_ids, params, deliver):
        seen.append(list(prompt_ids))
        return submit(prompt_ids, params, deliver)

    worker.submit = recording
    try:
        yield seen
    finally:
        del worker.submit


def test_the_served_chat_prompt_is_the_checkpoints_template(served):
    client, directory, tokenizer, greedy, worker = served
    for messages in CONVERSATIONS:
        ids = _theirs(directory, messages)
        expected = greedy(ids)
        with _submitted(worker) as seen:
            full = client.chat.completions.create(model="chat-test", messages=messages, max_tokens=NEW_TOKENS,
                                                  temperature=0)
            chunks = list(client.chat.completions.create(model="chat-test", messages=messages,
                                                         max_tokens=NEW_TOKENS, temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
        assert seen == [ids, ids]
        assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(ids)
        assert full.choices[0].model_extra["token_ids"] == expected
        assert full.choices[0].message.content == tokenizer.decode(expected)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tokenizer.decode(expected)
    with _submitted(worker) as seen:  # completions are not templated
        client.completions.create(model="chat-test", prompt="the cat", max_tokens=1, temperature=0)
    assert seen == [tokenizer.encode("the cat")[0].tolist()]


def test_a_conversation_the_template_refuses_is_a_400_naming_messages(served):
    client, *_ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="chat-test", messages=[{"role": "assistant", "content": "hi"}],
                                       max_tokens=2)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == "messages" and error["code"] == "chat_template_error"
    assert "must not begin with an assistant message" in error["message"]
    ok = client.chat.completions.create(model="chat-test", messages=CONVERSATIONS[0], max_tokens=1)
    assert ok.choices[0].finish_reason == "length"  # the server goes on serving


def test_our_own_checkpoints_keep_the_plain_template(tmp_path, tiny_config):
    from latentmoe_lab.model import LatentMoEForCausalLM

    model = LatentMoEForCausalLM(tiny_config)
    model.save_pretrained(tmp_path)  # its tokenizer files are the byte tokenizer's
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": OTHER_TEMPLATE}))
    model.name_or_path = str(tmp_path)  # as from_pretrained records it
    texts = TokenText.of(model)
    assert texts.tokenizer is None and texts.chat_template is None
    assert _parsed_ids(texts, CONVERSATIONS[0]) == list(render_chat(CONVERSATIONS[0]).encode())
