"""One instance of a disaggregated service: an Engine in its own process, with a role (docs/design.md §13.2).

The router (router.py) talks to it over a Channel (serving/disagg/channel.py). Commands in, events out; `key` is the
router's request number, the engine's own ids never leave the process:

    router -> prefill             prefill -> router
      add key prompt params         ready identity vocab_size pid (once the engine is built; or
                                      failed why, and the process ends)
      abort key                     tokens key ids logprobs prompt_logprobs   (the first token, at once)
      release key (the decode       payload key start  + the encoded RequestCache as the frame's payload
        side acked: free blocks)    finished key reason error    (a request that ended here: max_tokens 1,
      resend key (it refused the                                   a stop id at the first token, an error)
        payload: export again)      stats {...}                   (after every step)
    router -> decode              decode -> router
      import key start + payload    imported key bytes seconds start  (the ack; seconds since export began)
      abort key                     refused key why              (checksum or format: the router asks again)
                                    tokens / finished / stats     as above
      steplog (both)                steplog [StepRecord]         (the engine's step log, serve-bench's timelines)
      stop (both)

A prefill instance runs each request until its first token (disagg.prefill_step exports and holds it), a
decode instance imports and decodes. A decode instance with no room for an import right now (slots, blocks)
keeps it and tries again after its next step. Anything that breaks the loop ends the process; the router
sees the channel close and recomputes what the instance held (router.py).

InstanceFaults are the tests' fault injection (never set from a service file).
"""
from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from latentmoe_lab.serving.config import ServiceConfig
from latentmoe_lab.serving.disagg.channel import Channel

IDLE_POLL_S = 0.5
FAULT_EXIT_CODE = 86


@dataclass(frozen=True)
class InstanceFaults:
    """Counted within one process (a restarted instance runs clean); 0: off."""

    exit_mid_transfer: int = 0  # prefill: exit while sending its n-th payload, half of the frame written
    corrupt_transfer: int = 0  # prefill: flip one byte of its n-th payload (a resend is clean)
    exit_at_decode_step: int = 0  # decode: exit before its n-th step (imported requests running)


@dataclass(frozen=True)
class InstanceSpec:
    role: str
    index: int
    config: ServiceConfig  # role_config(): parallel.role set, forward in this process
    model_loader: Callable  # module level: config -> model (the server passes its loader)
    faults: InstanceFaults = InstanceFaults()

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


def run_instance(spec: InstanceSpec, sock) -> None:
    """The body of an instance process (module level, so the forkserver can start it)."""
    from latentmoe_lab.serving import Engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the server's: it stops us
    torch.set_num_threads(spec.config.parallel.forward_threads or 1)
    channel = Channel(sock)
    try:
        model = spec.model_loader(spec.config)
        engine = Engine(model, spec.config)
    except Exception as error:  # a start-up refusal: the router names the role and raises it
        channel.send(("failed", f"{type(error).__name__}: {error}"))
        raise
    loop = (PrefillLoop if spec.role == "prefill" else DecodeLoop)(engine, channel, spec.faults)
    loop.announce(model)
    try:
        loop.run()
    except EOFError:  # the router went away: nothing to serve
        pass
    finally:
        engine.close()


class _Loop:
    def __init__(self, engine, channel: Channel, faults: InstanceFaults):
        self.engine, self.channel, self.faults = engine, channel, faults
        self.ids: dict[int, int] = {}  # key -> engine request id
        self.keys: dict[int, int] = {}  # engine request id -> key

    def announce(self, model) -> None:
        from latentmoe_lab.serving.transport import engine_identity

        self.channel.send(("ready", engine_identity(self.engine), model.config.vocab_size, os.getpid()))

    def run(self) -> None:
        while True:
            timeout, changed = 0.0 if self.busy() else IDLE_POLL_S, False
            while self.channel.poll(timeout):
                header, payload = self.channel.recv()
                if header[0] == "stop":
                    return
                if header[0] == "steplog":
                    self.channel.send(("steplog", list(self.engine.log.steps)))
                    continue
                self.command(header, payload)
                timeout, changed = 0.0, True
            if self.busy():
                self.step()
                changed = True
            if changed:  # releases and aborts free blocks without a step
                self.channel.send(("stats", _stats(self.engine)))

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def deliver(self, outputs) -> None:
        """Tokens and ends of the step's requests to the router."""
        for out in outputs:
            key = self.keys.get(out.request_id)
            if key is None:
                continue
            if out.new_token_ids or out.prompt_logprobs:
                logprobs = out.logprobs[len(out.logprobs) - len(out.new_token_ids):] if out.logprobs else []
                self.channel.send(("tokens", key, list(out.new_token_ids), logprobs, out.prompt_logprobs))
            if out.finished:
                self.forget(out.request_id)
                self.channel.send(("finished", key, out.finish_reason, out.error))

    def forget(self, request_id: int) -> None:
        key = self.keys.pop(request_id, None)
        self.ids.pop(key, None)

    def abort(self, key: int) -> None:
        request_id = self.ids.get(key)
        if request_id is not None:
            self.forget(request_id)
            try:
                self.engine.abort(request_id)
            except ValueError:
                pass  # finished in the step before the abort arrived


class PrefillLoop(_Loop):
    def __init__(self, engine, channel, faults):
        super().__init__(engine, channel, faults)
        self.sent = 0

    def command(self, header: tuple, _payload: bytes) -> None:
        from latentmoe_lab.serving.transport import export_request, release_exported

        kind, key = header[0], header[1]
        if kind == "add":
            try:
                request_id = self.engine.add_request(header[2], header[3])
            except ValueError as error:
                self.channel.send(("finished", key, "error", f"invalid_request: {error}"))
                return
            self.ids[key], self.keys[request_id] = request_id, key
        elif kind == "abort":
            request_id = self.ids.get(key)
            if request_id is not None and request_id in self.engine.held:
                self.forget(request_id)
                release_exported(self.engine, request_id)
            else:
                self.abort(key)
        elif kind == "release":
            request_id = self.ids.get(key)
            if request_id is not None:
                self.forget(request_id)
                release_exported(self.engine, request_id)
        elif kind == "resend":
            request_id = self.ids.get(key)
            if request_id is not None:
                self.send_payload(key, export_request(self.engine, request_id))

    def busy(self) -> bool:
        from latentmoe_lab.serving.transport.transfer import waiting_for_ack

        # held transfers keep the room a waiting request needs: sleep on the channel until an ack comes
        return self.engine.has_unfinished() and not waiting_for_ack(self.engine)

    def step(self) -> None:
        from latentmoe_lab.serving.transport import prefill_step

        outputs, caches = prefill_step(self.engine)  # settles a StepError itself
        self.deliver(outputs)
        for cache in caches:
            self.send_payload(self.keys[cache.request_id], cache)

    def send_payload(self, key: int, cache) -> None:
        from latentmoe_lab.serving.transport import encode

        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        payload = encode(cache)
        self.sent += 1
        if self.sent == self.faults.corrupt_transfer:
            payload = payload[:len(payload) // 2] + bytes([payload[len(payload) // 2] ^ 0x5A]) + \
                payload[len(payload) // 2 + 1:]
        if self.sent == self.faults.exit_mid_transfer:
            self.channel.send_cut(("payload", key, start), payload)
            os._exit(FAULT_EXIT_CODE)
        self.channel.send(("payload", key, start), payload)


class DecodeLoop(_Loop):
    def __init__(self, engine, channel, faults):
        super().__init__(engine, channel, faults)
        self.pending: deque = deque()  # (key, start, cache): no room yet
        self.steps = 0

    def busy(self) -> bool:
        return self.engine.has_unfinished() or bool(self.pending)

    def command(self, header: tuple, payload: bytes) -> None:
        from latentmoe_lab.serving.transport import TransferError, decode

        kind, key = header[0], header[1]
        if kind == "import":
            try:
                cache = decode(payload)
            except TransferError as error:
                self.channel.send(("refused", key, f"transfer_corrupt: {error}"))
                return
            self.pending.append((key, header[2], cache, len(payload)))
            self.admit()
        elif kind == "abort":
            self.pending = deque(entry for entry in self.pending if entry[0] != key)
            self.abort(key)

    def admit(self) -> None:
        """Import the waiting transfers in order while there is room; ack each one imported."""
        from latentmoe_lab.serving.transport import NoRoomError, import_request

        while self.pending:
            key, start, cache, size = self.pending[0]
            try:
                request_id = import_request(self.engine, cache)
            except NoRoomError:
                return
            except ValueError as error:  # another model or cache format: no resend can help
                self.pending.popleft()
                self.channel.send(("refused", key, f"transfer_incompatible: {error}"))
                continue
            self.pending.popleft()
            self.ids[key], self.keys[request_id] = request_id, key
            self.channel.send(("imported", key, size, time.monotonic() - start, start))

    def step(self) -> None:
        if self.engine.has_unfinished():
            self.steps += 1
            if self.steps == self.faults.exit_at_decode_step:
                os._exit(FAULT_EXIT_CODE)
            # a failed step is settled by the engine (failures.py): its requests recompute there
            self.deliver(self.engine.step_through_failures())
        self.admit()  # what finished made room


def _stats(engine) -> dict:
    stats = engine.stats()
    keep = ("running", "waiting", "blocks_used", "slots_used", "num_blocks", "num_slots", "prefill_tokens",
            "decode_tokens", "steps", "preemptions")
    return {key: stats[key] for key in keep} | {"held": len(engine.held), "time": time.monotonic()}
