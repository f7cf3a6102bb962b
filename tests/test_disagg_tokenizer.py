"""A transformers checkpoint served by a disaggregated service (docs/design.md §13.2, §17.6) encodes and decodes
with its own tokenizer.json and renders chat with its own template, as the colocated server does: the front end
(server/disagg_worker.py) points tokenizer_of at the checkpoint directory the instances load, and loads no weights.

One tiny random kimi_linear checkpoint (vocabulary 320, a byte-level BPE and a chat template of its own), served
colocated and then 1P1D; every answer's text, token ids and usage are the same, and they are the tokenizer's.
"""
from __future__ import annotations

import openai
import pytest

from latentmoe_lab.server.choices import TokenText
from latentmoe_lab.server.threaded import start_service
from latentmoe_lab.tokenizer import FileTokenizer
from tokenizer_cases import CHAT_TEMPLATE, save_bpe_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

PROMPTS = ["héllo 漢字 🙂", "the cat sat", "def add(a, b):\n"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "naïve café"}]
NEW_TOKENS = 8
TIMEOUT_S = 120  # each request; the instance processes start within the router's own START_TIMEOUT_S


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi_pd")
    return directory, save_bpe_checkpoint(directory, CHAT_TEMPLATE)


def _service(directory, disaggregated: bool) -> dict:
    service = {"model": {"name": "bpe-pd", "checkpoint": str(directory), "max_model_len": 128},
               "parallel": {"forward_threads": 1},
               "memory": {"max_num_seqs": 8, "block_size": 16, "cache_bytes": 4_000_000},
               "scheduler": {"max_batch_size": 64, "prefill_chunk_size": 32}}
    if disaggregated:
        service["disaggregation"] = {"prefill_instances": 1, "decode_instances": 1, "transport": "pipe"}
    return service


def _answers(url: str) -> dict:
    """Greedy completions (streamed and not) and a chat, each as (text, token ids, prompt tokens)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT_S)
    out = {}
    for prompt in PROMPTS:
        full = client.completions.create(model="bpe-pd", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        out[prompt] = (full.choices[0].text, full.choices[0].model_extra["token_ids"], full.usage.prompt_tokens)
        chunks = list(client.completions.create(model="bpe-pd", prompt=prompt, max_tokens=NEW_TOKENS,
                                                temperature=0, stream=True))
        out[prompt, "stream"] = ("".join(c.choices[0].text for c in chunks),
                                 [t for c in chunks for t in c.choices[0].model_extra["token_ids"]])
    chat = client.chat.completions.create(model="bpe-pd", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0)
    out["chat"] = (chat.choices[0].message.content, chat.choices[0].model_extra["token_ids"], chat.usage.prompt_tokens)
    return out


@pytest.fixture(scope="module")
def colocated(checkpoint):
    directory, _ = checkpoint
    with start_service(_service(directory, False)) as (served, _worker):
        return _answers(served.url)


def test_the_disaggregated_service_uses_the_checkpoints_tokenizer_and_template(checkpoint, colocated):
    directory, tokenizer = checkpoint
    with start_service(_service(directory, True)) as (served, worker):
        answers = _answers(served.url)
        texts = TokenText.of(worker.model)
    assert answers == colocated
    assert not hasattr(worker.model, "parameters")  # the front end holds no weights
    assert isinstance(texts.tokenizer, FileTokenizer) and texts.tokenizer.path == tokenizer.path
    assert texts.chat_template is not None
    for prompt in PROMPTS:  # and they are the tokenizer's, not bytes
        text, ids, prompt_tokens = answers[prompt]
        assert text == tokenizer.decode(ids) and prompt_tokens == len(tokenizer.encode(prompt)[0])
    chat_ids = transformers.AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert answers["chat"][0] == tokenizer.decode(answers["chat"][1]) and answers["chat"][2] == len(chat_ids)
