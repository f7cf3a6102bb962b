"""The row transport (docs/design.md §13.1): one request's hybrid cache as rows, out of one engine and into another.

Used by prefill/decode disaggregation (serving/disagg/, the service around it), by the prefix-cache spill
(serving/cache_tiers/) and by the worker processes (serving/workers/), which hold the pools under TP.

    request_cache.py   RequestCache (the transfer set), CacheIdentity, check_compatible
    pool_rows.py       a request's pool rows as stored bytes, read and written
    tp_rows.py         the same rows gathered from / sliced for tensor-parallel worker processes
    transfer.py        prefill_step / export_request / release_exported, import_request
    wire.py            encode / decode with a SHA-256 per transfer
    transfer_bytes.py  bytes_per_request: the payload planned from the config
"""
from latentmoe_lab.serving.transport.request_cache import (CacheIdentity, RequestCache, check_compatible,
                                                         engine_identity)
from latentmoe_lab.serving.transport.transfer import (NoRoomError, export_request, held_requests, held_sequence,
                                                    import_request, prefill_step, release_exported,
                                                    waiting_for_ack)
from latentmoe_lab.serving.transport.transfer_bytes import bytes_per_request, payload_shapes, transfer_bytes_by_kind
from latentmoe_lab.serving.transport.wire import TransferError, decode, encode

__all__ = ["CacheIdentity", "NoRoomError", "RequestCache", "TransferError", "bytes_per_request", "check_compatible",
           "decode", "encode", "engine_identity", "export_request", "held_requests", "held_sequence", "import_request",
           "payload_shapes", "prefill_step", "release_exported", "transfer_bytes_by_kind",
           "waiting_for_ack"]
