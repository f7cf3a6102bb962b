"""The connector: one request's cache from a prefill engine's pools into a decode engine's (docs/design.md §13.1).

Boundary rule: the prefill side computes all N prompt tokens and samples the first token; what travels
is the state after N (DSA rows of tokens 0..N-1, KDA state and conv tail after token N-1, and with an MTP
head the hidden row at N-1, spec/hidden_rows.py), the first token and the generator after its draw. The
decode side enters the sequence with num_computed = N and token_ids = prompt + [first token], so its first
step is an ordinary decode of the first token; a speculating decode engine proposes its drafts at the
import (the MTP drafter from the carried row), so that step verifies them.

    prefill engine                                       decode engine
    prefill_step(engine) -> (outputs, [RequestCache])    import_request(engine, cache) -> request id
        engine.step(); each request that got its first       identity checked (ValueError naming the key),
        token is exported: rows read, the sequence           slot + blocks allocated (NoRoomError if none),
        detached with its blocks and slot HELD               rows written, the sequence adopted as running
    release_exported(engine, request id)  <----- ack ----- (after the import succeeded)

A held request is out of the scheduler: no step touches its rows, so export_request may read it again
(a resend after a corrupted transfer). Its blocks and slot go back only at release_exported.
"""
from __future__ import annotations

import torch

from latentmoe_lab.quant.kv import PLAIN_DTYPES
from latentmoe_lab.serving.sequence import Sequence, Status
from latentmoe_lab.serving.spec.slots import acquire_slots, release_slots
from latentmoe_lab.serving.transport.pool_rows import flat_positions
from latentmoe_lab.serving.transport.request_cache import RequestCache, check_compatible, engine_identity


class NoRoomError(RuntimeError):
    """The decode engine has no KDA slot, not enough free blocks, or no queue room for the request now."""


def prefill_step(engine) -> tuple[list, list[RequestCache]]:
    """One step of a prefill engine -> (its RequestOutputs, the caches of the requests it gave their first token).

    A request that finished at its first token (max_tokens 1, a stop id) is in the outputs, finished, and is
    not exported. A failed step (StepError) gives the outputs it finished; its requests are recomputed.
    While held requests keep every slot (or block) and nothing runs, there is nothing to step: ([], []) until
    an ack frees room.
    """
    if waiting_for_ack(engine):
        return [], []
    outputs = engine.step_through_failures()
    caches = [export_request(engine, out.request_id) for out in outputs
              if not out.finished and len(out.token_ids) == 1 and out.request_id not in held_requests(engine)]
    return outputs, caches


def waiting_for_ack(engine) -> bool:
    """True when nothing runs and the held requests' slots or blocks keep the waiting head out: a step could
    do nothing (the engine would raise rather than spin), so a prefill loop waits for the next ack."""
    scheduler, manager = engine.scheduler, engine.block_manager
    if scheduler.running or not scheduler.waiting or not held_requests(engine):
        return False
    return len(manager.free_slots) < 1 + scheduler.spec_tokens or manager.num_free_blocks == 0


def export_request(engine, request_id: int) -> RequestCache:
    """Read a request's cache after the step that sampled its first token, and hold its blocks and slot.

    Called again on a held request, reads it again. ValueError if the request is not at the boundary.
    """
    held = engine.held
    if request_id in held:
        seq, manager = held[request_id]
        if manager is not engine.block_manager:
            raise ValueError(f"request_id: request {request_id}'s cache was lost when the worker group restarted; "
                             f"release it and recompute the request")
    else:
        seq = engine.sequence(request_id)  # read only: engine.detach() takes it out
        if seq is None or seq.status is not Status.RUNNING:
            raise ValueError(f"request_id: no running request {request_id} on this engine")
        if seq.num_computed != len(seq.prompt_ids) or len(seq.generated_ids) != 1:
            raise ValueError(f"request_id: request {request_id} is not at the prefill boundary (computed "
                             f"{seq.num_computed} of {len(seq.prompt_ids)} prompt tokens, "
                             f"{len(seq.generated_ids)} generated; export right after its first token)")
        if seq.images is not None:
            raise ValueError(f"request_id: request {request_id} has images; a transfer carries text prompts only "
                             f"(the decode side could not recompute it after a preemption)")
    positions = flat_positions(seq.block_table, engine.block_manager.block_size, seq.num_computed)
    rows = engine.runner.read_rows(positions, seq.slot)  # before detaching: a lost worker group recomputes it
    if request_id not in held:
        held[request_id] = (engine.detach(request_id), engine.block_manager)
    return RequestCache(request_id, list(seq.prompt_ids), seq.token_ids[-1], seq.params, seq.max_tokens,
                        engine_identity(engine), seq.generator.get_state(), logprobs=list(seq.logprobs),
                        prompt_logprobs=list(seq.prompt_logprobs), mtp_hidden=exported_hidden_row(engine, seq.slot),
                        **rows)


def exported_hidden_row(engine, slot: int) -> torch.Tensor:
    """[1, hidden]: the MTP hidden row kept beside the request's slot (the row of its last prompt position,
    spec/hidden_rows.py); [0, hidden] for a model without an MTP head."""
    if engine.slot_hidden is None:
        return torch.zeros(0, engine.model_config.hidden_size, dtype=PLAIN_DTYPES[engine.config.compute_dtype])
    row = engine.slot_hidden.stored(slot)
    if row is None:  # every step writes its sequences' rows: a request at the boundary always has one
        raise RuntimeError(f"slot {slot}: no MTP hidden row after the prefill step")
    return row[None]


def held_requests(engine) -> list[int]:
    """Request ids exported from this engine and not yet released."""
    return list(engine.held)


def held_sequence(engine, request_id: int) -> Sequence:
    """The held (exported, not yet released) sequence of request_id: its block table and slot (tests, metrics)."""
    if request_id not in engine.held:
        raise ValueError(f"request_id: request {request_id} is not held by this engine")
    return engine.held[request_id][0]


def release_exported(engine, request_id: int) -> None:
    """The decode side's ack: give the held request's blocks and slot back (prefix-cached blocks stay cached)."""
    if request_id not in engine.held:
        raise ValueError(f"request_id: request {request_id} is not held by this engine (released already?)")
    seq, manager = engine.held.pop(request_id)
    if manager is engine.block_manager:  # else the bookkeeping was rebuilt empty: nothing left to give back
        manager.release_blocks(seq.block_table)
        release_slots(manager, seq)  # its slot, and the spare ones of speculative decoding
    seq.block_table, seq.slot, seq.spare_slots, seq.status = [], None, [], Status.FINISHED


def import_request(engine, cache: RequestCache) -> int:
    """Enter a transferred request into a decode engine as running, its cache written into the pools.

    ValueError naming the key for a cache this engine cannot take (another model or cache format, a prompt
    too long for model.max_model_len, malformed tensors); NoRoomError when it could later but not now.
    """
    if not isinstance(cache, RequestCache):
        raise TypeError(f"cache: expected a RequestCache, got {type(cache).__name__}")
    check_compatible(engine_identity(engine), cache.identity)
    cache.check(engine.model_config)
    limit, n = engine.config.model.max_model_len, cache.num_tokens
    if n + 1 >= limit:
        raise ValueError(f"model.max_model_len: ({limit}) leaves no room to decode after {n} prompt tokens "
                         f"and the first generated one")
    max_tokens = min(cache.max_tokens, limit - n)
    if max_tokens <= 1:
        raise ValueError(f"max_tokens: {cache.max_tokens} leaves nothing to decode after the first token")
    scheduler, manager = engine.scheduler, engine.block_manager
    if scheduler.num_unfinished >= engine.config.scheduler.max_batch_size or \
            len(scheduler.running) >= scheduler.max_num_seqs:
        raise NoRoomError(f"no room: {scheduler.num_unfinished} requests held, {len(scheduler.running)} running")
    blocks_needed, slots_needed = -(-n // manager.block_size), 1 + scheduler.spec_tokens  # K spares (§12)
    if blocks_needed > manager.num_free_blocks or len(manager.free_slots) < slots_needed:
        raise NoRoomError(f"no room: {blocks_needed} blocks needed, {manager.num_free_blocks} free; "
                          f"{slots_needed} KDA slots needed, {len(manager.free_slots)} free")
    (slot, *spares), blocks = acquire_slots(manager, slots_needed), manager.allocate_blocks(blocks_needed)
    positions = flat_positions(blocks, manager.block_size, n)
    try:
        engine.runner.write_rows(positions, slot, cache.pool_rows())  # with workers, each rank its layers and heads
    except BaseException:  # a worker group lost mid-write (WorkerGroupError): nothing stays held
        manager.release_blocks(blocks)
        for held_slot in (slot, *spares):
            manager.release_slot(held_slot)
        raise

    def make_sequence(request_id: int) -> Sequence:
        seq = Sequence(request_id, list(cache.prompt_ids), cache.params, max_tokens=max_tokens)
        seq.token_ids.append(cache.first_token)
        seq.generator.set_state(cache.generator_state.clone())
        seq.logprobs, seq.prompt_logprobs = list(cache.logprobs), list(cache.prompt_logprobs)
        seq.slot, seq.spare_slots, seq.block_table = slot, spares, blocks
        seq.num_computed, seq.status = n, Status.RUNNING
        seq.first_scheduled_time = seq.arrival_time  # its first token came with it
        seq.token_times.append(seq.arrival_time)
        return seq

    if engine.slot_hidden is not None:  # in the engine's process, beside the slot it continues from
        engine.slot_hidden.write(slot, cache.mtp_hidden[0])
    seq = engine.adopt(make_sequence)
    if engine.speculator is not None:  # drafts for its first step, the MTP ones from the carried row
        engine.speculator.start_imported(seq, None if engine.slot_hidden is None else engine.slot_hidden.read(slot))
    return seq.request_id

