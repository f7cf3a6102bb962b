"""Bad requests fail alone: a clear error for that request, every other request served in full (docs/design.md §6.6)."""
import pytest
import torch

from latentmoe_lab.multimodal import ImageTextProcessor
from latentmoe_lab.serving import Engine, QueueFullError, SamplingParams, ServiceConfig, StepError


def make_engine(model, max_batch_size=16):
    return Engine(model, ServiceConfig.from_dict({
        "model": {"max_model_len": 64},
        "memory": {"cache_bytes": 500_000, "block_size": 16, "max_num_seqs": 4},
        "scheduler": {"prefill_chunk_size": 32, "max_batch_size": max_batch_size}}))


GOOD = [[1, 2, 3], [7] * 20]


def good_reference(model):
    return [model.generate(torch.tensor([p]), 3)[0, len(p):].tolist() for p in GOOD]


@pytest.mark.parametrize("params", [dict(max_tokens=-1), dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(seed=-2), dict(stop_token_ids=[-1]),
                                    dict(temperature=float("nan"))])
def test_bad_sampling_params_name_the_field(params):
    name = next(iter(params))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**params)


def test_each_bad_prompt_fails_alone(model):
    processor = ImageTextProcessor(model.config)
    image = torch.rand(3, 56, 56)
    one_image = processor("<image>hi", image)
    bad_prompts = {
        "too long": list(range(64)),  # max_model_len 64 leaves no room to generate
        "empty": [],
        "empty text": "",
        "out of vocab": [1, 10_000],
        "more images than markers": {"text": "<image>two?", "images": [image, image]},
        "more images than placeholders": {"input_ids": one_image.input_ids,
                                          "pixel_values": torch.cat([one_image.pixel_values] * 2),
                                          "image_grids": torch.cat([one_image.image_grids] * 2)},
        "not a prompt": 3.5,
    }
    expected = {"too long": "max_model_len", "empty": "empty", "empty text": "empty", "out of vocab": "vocab|lie in",
                "more images than markers": "markers", "more images than placeholders": "placeholder",
                "not a prompt": "prompt"}
    engine = make_engine(model)
    for name, prompt in bad_prompts.items():
        with pytest.raises((ValueError, TypeError), match=expected[name]):
            engine.add_request(prompt, SamplingParams(max_tokens=3))
    assert engine.stats()["waiting"] == 0  # nothing half-added

    prompts = [GOOD[0], *bad_prompts.values(), GOOD[1]]
    outputs = make_engine(model).generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.token_ids for o in (outputs[0], outputs[-1])] == good_reference(model)
    assert all(o.finish_reason == "error" and o.error for o in outputs[1:-1])


def test_full_queue_refuses_the_newcomer_only(model):
    engine = make_engine(model, max_batch_size=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in GOOD + GOOD]
    with pytest.raises(QueueFullError, match="queue full"):
        engine.add_request([5, 6], SamplingParams(max_tokens=3))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == good_reference(model) * 2
    # and generate() over the same engine takes any number of prompts, feeding them as room frees
    outputs = engine.generate(GOOD * 3, SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.token_ids for o in outputs] == good_reference(model) * 3


def test_non_finite_logits_fail_that_request_only(model):
    engine = make_engine(model)
    victim = engine.add_request([9, 9, 9], SamplingParams(max_tokens=3))
    others = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in GOOD]
    original = engine.runner.run

    def poisoned_run(batch):
        output = original(batch)
        for i, (seq, _) in enumerate(batch.entries):
            if seq.request_id == victim:
                output.logits[i] = float("nan")
        return output

    engine.runner.run = poisoned_run
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[victim].finish_reason == "error" and "non-finite" in done[victim].error
    assert [done[i].token_ids for i in others] == good_reference(model)
    assert engine.stats()["blocks_used"] == 0 and engine.stats()["slots_used"] == 0


def test_stop_token_and_max_model_len_end_a_request(model):
    prompt = list(range(30, 50))
    reference = model.generate(torch.tensor([prompt]), 6)[0, len(prompt):].tolist()
    cut = next(i for i in range(1, 6) if reference[i] not in reference[:i])  # a stop id first sampled at step cut
    engine = make_engine(model)
    out = engine.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=[reference[cut]]), use_tqdm=False)[0]
    assert out.token_ids == reference[:cut + 1] and out.finish_reason == "stop"
    long = list(range(60))  # 4 tokens of room under max_model_len 64
    out = engine.generate([long], SamplingParams(max_tokens=50), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_engine_refuses_configs_it_cannot_serve(model):
    base = {"model": {"max_model_len": 64}, "memory": {"cache_bytes": 500_000, "block_size": 16, "max_num_seqs": 4}}
    with pytest.raises(ValueError, match="parallel.tensor_parallel_size: 3 must divide"):  # 2 runs: 2 processes
        Engine(model, ServiceConfig.from_dict(base | {"parallel": {"tensor_parallel_size": 3}}))
    with pytest.raises(ValueError, match="model.max_model_len"):
        Engine(model, ServiceConfig.from_dict(base | {"model": {"max_model_len": 10**6}}))
    with pytest.raises(ValueError, match="memory.cache_bytes"):  # a budget that cannot hold one sequence
        Engine(model, ServiceConfig.from_dict(base | {"memory": {"cache_bytes": 1000, "max_num_seqs": 4}}))
    with pytest.raises(ValueError, match="model.dtype: the config says bf16"):
        Engine(model, ServiceConfig.from_dict(base | {"model": {"max_model_len": 64, "dtype": "bf16"}}))
    with pytest.raises(TypeError, match="service_config"):
        Engine(model, base)


def test_a_failed_forward_leaves_no_half_advanced_state(model):
    """A forward that raises mid-step: the step's sequences are recomputed from scratch, outputs unchanged."""
    engine = make_engine(model)
    ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in GOOD]
    engine.step()  # both prefilled and decoding
    original, calls = engine.runner.run, []

    def failing_once(batch):
        calls.append(len(batch.entries))
        if len(calls) == 1:
            original(batch)  # the pools advance, then the step fails
            raise RuntimeError("device lost")
        return original(batch)

    engine.runner.run = failing_once
    with pytest.raises(StepError, match="device lost") as caught:
        engine.step()
    assert sorted(caught.value.request_ids) == sorted(ids) and caught.value.retried == []  # two: bisected
    assert engine.stats()["running"] == 0 and engine.stats()["blocks_used"] == 0
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == good_reference(model)
