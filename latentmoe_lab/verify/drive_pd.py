"""The p/d pass of verify: each prompt prefilled on a prefill-role engine, its cache moved through the
checksummed wire format into a decode-role engine, and decoded there (docs/design.md §13.1).

Both engines run in this process on the file's role configs (role_config: the file with that role's
overrides), so the path compared is exactly what the service's instances run: export after the first
token, encode, decode, import, ack. `on_payload` sees each RequestCache between the two engines (verify's
injections corrupt it there; identity otherwise).
"""
from __future__ import annotations

from collections.abc import Callable

from latentmoe_lab.serving import SamplingParams, ServiceConfig
from latentmoe_lab.serving.disagg.section import role_config
from latentmoe_lab.serving.transport import (NoRoomError, decode, encode, import_request, prefill_step,
                                            release_exported)
from latentmoe_lab.verify.drive import EngineRun, paths_of
from latentmoe_lab.verify.workload import VerifyPrompt


PREFILL_KEY, DECODE_KEY = 2, 3  # engine keys of this pass (verify/layer.py tells engines apart by them)


def run_pd(model, service: ServiceConfig, prompts: list[VerifyPrompt], max_tokens: int, tick, make_engine,
           on_payload: Callable = lambda cache: cache) -> list[EngineRun]:
    """The cold and warm prompts through prefill -> wire -> decode; one EngineRun per prompt, in order."""
    chosen = [p for p in prompts if p.wave in ("cold", "warm")]
    prefill = make_engine(model, role_config(service, "prefill"), PREFILL_KEY)
    decoder = make_engine(model, role_config(service, "decode"), DECODE_KEY)
    params = SamplingParams(max_tokens=max_tokens, logprobs=0)
    try:
        index_of = {prefill.add_request(p.token_ids, params): i for i, p in enumerate(chosen)}
        finished: list = [None] * len(chosen)
        pending, decode_index, prefill_id, prefill_only = [], {}, {}, set()
        while prefill.has_unfinished() or decoder.has_unfinished() or pending:
            if prefill.has_unfinished():
                outputs, caches = prefill_step(prefill)
                for out in outputs:  # finished at its first token: never exported
                    if out.finished:
                        finished[index_of[out.request_id]] = out
                        prefill_only.add(index_of[out.request_id])
                pending += caches
            while pending:
                try:
                    decode_id = import_request(decoder, decode(encode(on_payload(pending[0]))))
                except NoRoomError:
                    break
                cache = pending.pop(0)
                release_exported(prefill, cache.request_id)
                decode_index[decode_id] = index_of[cache.request_id]
                prefill_id[index_of[cache.request_id]] = cache.request_id
            if decoder.has_unfinished():
                for out in decoder.step():
                    if out.finished:
                        finished[decode_index[out.request_id]] = out
    finally:
        prefill.close()
        decoder.close()
    tick(len(chosen))
    runs = []
    for i, (prompt, out) in enumerate(zip(chosen, finished)):
        paths = paths_of(service, prompt, out, tier_hit=False, migrating=False)
        sources = [(PREFILL_KEY if i in prefill_only else DECODE_KEY, out.request_id)]
        if i in prefill_id:  # moved: its prompt was computed on the prefill engine
            paths.append("p/d import")
            sources.append((PREFILL_KEY, prefill_id[i]))
        runs.append(EngineRun(prompt, list(out.token_ids), [lp.logprob for lp in out.logprobs], paths, out.error,
                              sources))
    return runs
