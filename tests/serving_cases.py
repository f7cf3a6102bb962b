"""What the multi-process serving tests share: one small paged service, ragged prompts, the one-process tokens.

Ragged: one token, under / over a block (16) and a chunk (32: chunked prefills); prompts 1..n share
prefixes (prefix-cache hits, KDA snapshots).
"""
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

SERVICE = {"model": {"preset": "tiny", "max_model_len": 256},
           "memory": {"max_num_seqs": 4, "block_size": 16, "cache_bytes": 2_000_000, "prefix_cache": {}},
           "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 32}}
PROMPTS = [list(range(1, 1 + n)) for n in (1, 5, 17, 40, 33, 2, 64)] + [[7, 300, 11, 42, 5, 9, 260, 3, 1]]
PARAMS = SamplingParams(max_tokens=6)


def one_process_tokens(model, prompts) -> list[list[int]]:
    """Greedy tokens of the single-process engine on SERVICE: what every parallel layout must reproduce."""
    outputs = Engine(model, ServiceConfig.from_dict(SERVICE)).generate(prompts, PARAMS, use_tqdm=False)
    return [o.token_ids for o in outputs]


def started_engine(model, parallel: dict):
    """Yield an Engine on SERVICE with this `parallel` section (its workers started), closed afterwards."""
    engine = Engine(model, ServiceConfig.from_dict(SERVICE | {"parallel": parallel}))
    yield engine
    engine.close()
