"""MTP speculative decoding with the forward on worker processes (docs/design.md §12): the answer rank sends
back the rows of the last hidden state that the step asks for (ForwardBatch.hidden_index), and the engine's
MTP drafter reads them as it reads the in-process runner's.

A random tiny model's MTP head never drafts what the target picks, so the model here is bent into an echo:
embeddings five times larger (with the LM head tied to them) keep the newest token strong in the residual
stream, so the target often repeats it, and the MTP depth's token half of its input projection is the
identity, so it mostly drafts that token. Drafts are then accepted and rejected. They hardly depend on the
hidden rows (the random hidden half of the projection is small), so besides the drafts, the rows each
propose received on workers are compared with those it received in process.
"""
import dataclasses

import pytest
import torch

from spec_cases import echo_model  # noqa: F401

from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.workers.parallel_worker import pack_batch
from latentmoe_lab.serving.spec.drafters import Drafter

LENGTHS = [1, 7, 17, 33, 50]  # ragged; chunks of 16 split the longer prompts
PARAMS = SamplingParams(max_tokens=10)
LAYOUTS = {"forward-process": {"forward_process": True}, "tp2": {"tensor_parallel_size": 2},
           "tp2-pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


class Recorder(Drafter):
    """The engine's MTP drafter, recording each propose: request tokens -> (hidden rows handed in, drafts)."""

    name = "mtp"

    def __init__(self, inner):
        self.inner, self.calls = inner, {}

    def propose(self, request_id, draft_input, k):
        drafts = self.inner.propose(request_id, draft_input, k)
        self.calls[tuple(draft_input.tokens)] = (draft_input.hidden.clone(), drafts)
        return drafts

    def release(self, request_id):
        self.inner.release(request_id)


def serve(model, prompts, parallel):
    """Greedy tokens, the recorded proposals and the stats of an mtp engine (K = 3) with this layout, drained."""
    engine = Engine(model, ServiceConfig.from_dict({
        "model": {"max_model_len": 256}, "parallel": parallel,
        "memory": {"cache_bytes": 3_000_000, "block_size": 16, "max_num_seqs": 4},
        "scheduler": {"prefill_chunk_size": 16}, "speculative": {"method": "mtp", "num_speculative_tokens": 3}}))
    recorder = engine.speculator.drafter = Recorder(engine.speculator.drafter)
    try:
        outputs = engine.generate(prompts, PARAMS, use_tqdm=False)
        stats = engine.stats()
        wire = None if not parallel else hidden_over_the_wire(engine)
    finally:
        engine.close()
    assert all(out.error is None for out in outputs)
    assert (stats["blocks_used"], stats["slots_used"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
    spec = {key: value for key, value in stats.items() if key.startswith("spec_")}
    return [out.token_ids for out in outputs], recorder.calls, spec, wire


def hidden_over_the_wire(engine):
    """One ragged step sent to the drained group by hand, without and with a hidden_index -> (its hidden
    answers, the batch with the index): the rows come back only when asked for."""
    batch = ForwardBatch.from_sequences([[5, 9, 2, 7, 1], [3, 8]], [0, 0], [[0], [1]], state_slots=[0, 1],
                                        block_size=16)
    without = engine.runner.group.step(*pack_batch(batch, []))[4]
    batch = dataclasses.replace(batch, hidden_index=torch.tensor([6, 0, 3, 5]))
    return without, engine.runner.group.step(*pack_batch(batch, []))[4], batch


@pytest.fixture(scope="module")
def in_process(echo_model, prompts):
    return serve(echo_model, prompts, {})


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_mtp_on_workers_drafts_from_the_same_hidden_rows_and_keeps_greedy_exact(echo_model, prompts, in_process,
                                                                               layout):
    tokens, calls, spec, (without, rows, batch) = serve(echo_model, prompts, LAYOUTS[layout])
    for prompt, got in zip(prompts, tokens):
        expected = echo_model.generate(torch.tensor([prompt]), PARAMS.max_tokens)[0, len(prompt):].tolist()
        assert got == expected, f"prompt of {len(prompt)} tokens"
    local_tokens, local_calls, local_spec, _ = in_process
    assert tokens == local_tokens
    assert 0 < spec["spec_accepted_tokens"] < spec["spec_draft_tokens"]  # accepted and rejected drafts
    assert spec == local_spec
    # every propose saw the hidden rows the in-process forward gave (TP sums in another order: to rounding)
    assert calls.keys() == local_calls.keys()
    for key, (hidden, drafts) in calls.items():
        local_hidden, local_drafts = local_calls[key]
        assert drafts == local_drafts, f"drafts after {len(key)} tokens"
        torch.testing.assert_close(hidden, local_hidden, rtol=1e-4, atol=1e-4)
    # by hand: no hidden bytes without a hidden_index; with one, the plain forward's rows before the final norm
    assert without is None
    captured = []
    hook = echo_model.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0][0]))
    try:
        with torch.no_grad():
            for sequence in ([5, 9, 2, 7, 1], [3, 8]):
                echo_model(torch.tensor([sequence]))
    finally:
        hook.remove()
    torch.testing.assert_close(rows, torch.cat(captured)[batch.hidden_index], rtol=1e-4, atol=1e-4)
