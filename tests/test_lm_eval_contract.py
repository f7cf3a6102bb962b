"""lm-evaluation-harness, a client nobody here wrote, against a live `latentmoe-lab serve` on 127.0.0.1.

Its `local-completions` model type runs the two tasks of tests/data/lm_eval_tasks (multiple choice, scored by
loglikelihood through /v1/completions with echo + logprobs, and generate_until) with the checkpoint's own
tokenizer.json; `local-chat-completions` runs the generate_until task through /v1/chat/completions. Every
per-document score must equal the one computed here from the same weights' logits: each choice's summed
logprob (to 1e-4) and whether it is greedy, each greedy completion's text, and so the task metrics.
No network: the data are local JSONL files and the Hugging Face libraries run offline.
"""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.server.protocol import render_chat
from latentmoe_lab.server.threaded import free_port
from latentmoe_lab.tokenizer import BOS_TOKEN_ID, ByteTokenizer

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "tests" / "data" / "lm_eval_tasks"
MC_TASK, GEN_TASK, PPL_TASK = "latentmoe_mc_python", "latentmoe_gen_python", "latentmoe_ppl_python"
SERVED_NAME = "tiny-eval"  # the checkpoint directory's name, which serve answers to
SERVICE_YAML = """model: {preset: tiny, max_model_len: 512}
memory: {max_num_seqs: 8, block_size: 16, cache_bytes: 8000000}
scheduler: {prefill_chunk_size: 128}
"""
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return LatentMoEForCausalLM(ModelConfig.from_preset("tiny")).save_pretrained(
        tmp_path_factory.mktemp("lm_eval") / SERVED_NAME)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """`latentmoe-lab serve --checkpoint DIR` in its own process on a free loopback port; yields its URL."""
    config = tmp_path_factory.mktemp("service") / "service.yaml"
    config.write_text(SERVICE_YAML)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "latentmoe_lab", "serve", "--config", str(config),
                                "--checkpoint", str(checkpoint), "--port", str(port), "--threads", "1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            if process.poll() is not None:
                pytest.fail(f"serve exited with status {process.returncode}: {process.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("serve did not answer /health within 180 s")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def evaluate(tmp_path_factory):
    """simple_evaluate(model type, model_args, tasks) -> lm-eval's results, run offline from the repository root
    (the task files name their data relative to it)."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(OFFLINE, HF_HOME=str(tmp_path_factory.mktemp("hf_home")))
    os.chdir(REPO)
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS))

    def run(model: str, model_args: dict, tasks: list[str], **kwargs) -> dict:
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                       log_samples=True, **kwargs)
    try:
        yield run
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The same weights in this process: loglikelihood(context, continuation) and greedy(prompt) from the logits."""
    model = LatentMoEForCausalLM.from_pretrained(checkpoint)
    tokenizer = ByteTokenizer(model.config.vocab_size)

    @torch.no_grad()
    def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
        spaces = len(context) - len(context.rstrip())  # lm-eval scores a context's trailing whitespace as
        if spaces:                                       # part of the continuation (its _encode_pair)
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        start, ids = len(context.encode()), list((context + continuation).encode())
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        rows, targets = logprobs[start - 1:-1], torch.tensor(ids[start:])
        return float(rows.gather(1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all())

    @torch.no_grad()
    def greedy(prompt: str, max_tokens: int, until: list[str]) -> str:
        prompt_ids = tokenizer.encode(prompt)
        ids = model.generate(prompt_ids, max_new_tokens=max_tokens)[0, prompt_ids.shape[1]:]
        text = tokenizer.decode(ids)
        for stop in until:
            text = text.split(stop)[0]
        return text

    return loglikelihood, greedy


def _samples(results: dict, task: str) -> list[dict]:
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    assert samples, f"lm-eval scored no documents of {task}"
    return samples


def _check_generations(results: dict, greedy, render) -> None:
    """Each document's completion equals the in-process greedy one, and exact_match follows from it.
    render: the request lm-eval logged -> the prompt text the server runs."""
    samples = _samples(results, GEN_TASK)
    expected_scores = []
    for sample in samples:
        request, options = sample["arguments"][0]
        expected = greedy(render(request), options["max_gen_toks"], options["until"])
        assert sample["resps"][0][0] == expected, sample["doc"]
        expected_scores.append(float(expected == sample["target"]))
        assert sample["exact_match"] == expected_scores[-1]
    assert results["results"][GEN_TASK]["exact_match,none"] == pytest.approx(sum(expected_scores) / len(samples))


def test_local_completions_scores_equal_the_models_logits(server, checkpoint, evaluate, reference):
    loglikelihood, greedy = reference
    results = evaluate("local-completions", {
        "base_url": server + "/v1/completions", "model": SERVED_NAME, "tokenizer": str(checkpoint),
        "tokenizer_backend": "huggingface", "num_concurrent": 4, "max_retries": 1},  # token ids go as prompts
        [MC_TASK, GEN_TASK])
    accuracies = []
    for sample in _samples(results, MC_TASK):
        scores = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            score, is_greedy = response[0]
            expected_score, expected_greedy = loglikelihood(context, continuation)
            assert score == pytest.approx(expected_score, abs=1e-4), (context, continuation)
            assert bool(is_greedy) == expected_greedy, (context, continuation)
            scores.append(expected_score)
        accuracies.append(float(max(range(len(scores)), key=scores.__getitem__) == sample["doc"]["label"]))
        assert sample["acc"] == accuracies[-1]
    assert results["results"][MC_TASK]["acc,none"] == pytest.approx(sum(accuracies) / len(accuracies))
    _check_generations(results, greedy, render=lambda prompt: prompt)


def test_local_chat_completions_generations_equal_the_models(server, evaluate, reference):
    _, greedy = reference
    results = evaluate("local-chat-completions", {
        "base_url": server + "/v1/chat/completions", "model": SERVED_NAME, "max_retries": 1},
        [GEN_TASK], apply_chat_template=True)
    # lm-eval logs a chat request as [messages as JSON]; the server renders them with its chat template
    _check_generations(results, greedy, render=lambda request: render_chat(json.loads(request[0])))


@torch.no_grad()
def _after_bos(checkpoint: Path, text: str) -> float:
    """The summed logprob of text's bytes after the checkpoint's bos_token, from the weights' own logits."""
    model = LatentMoEForCausalLM.from_pretrained(checkpoint)
    ids = [BOS_TOKEN_ID, *text.encode()]
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return float(logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())


def test_perplexity_and_an_empty_context_score_after_the_tokenizers_bos(server, checkpoint, evaluate):
    """loglikelihood_rolling (every perplexity task) and an empty-context loglikelihood need a prefix token:
    the checkpoint's tokenizer files declare bos_token "<bos>", so lm-eval sends its id, not null (a 400)."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    model_args = {"base_url": server + "/v1/completions", "model": SERVED_NAME, "tokenizer": str(checkpoint),
                  "tokenizer_backend": "huggingface", "max_retries": 1}
    results = evaluate("local-completions", model_args, [PPL_TASK])
    log_likelihoods, total_bytes = [], 0
    for sample in _samples(results, PPL_TASK):
        text = sample["doc"]["text"]
        log_likelihoods.append(_after_bos(checkpoint, text))
        assert sample["resps"][0][0] == pytest.approx(log_likelihoods[-1], abs=1e-4), text
        total_bytes += len(text.encode())
    bits_per_byte = -sum(log_likelihoods) / total_bytes / math.log(2)
    assert results["results"][PPL_TASK]["bits_per_byte,none"] == pytest.approx(bits_per_byte, rel=1e-5)
    lm = get_model("local-completions")(**model_args)
    request = Instance(request_type="loglikelihood", doc={}, arguments=("", "def f():"), idx=0)
    [(score, _)] = lm.loglikelihood([request])
    assert score == pytest.approx(_after_bos(checkpoint, "def f():"), abs=1e-4)
