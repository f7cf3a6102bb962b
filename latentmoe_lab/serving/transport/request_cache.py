"""The transfer set of one request, in memory, and what both sides must agree on (docs/design.md §13.1).

A RequestCache is everything a decode instance needs to continue a request whose N prompt tokens a
prefill instance computed (the boundary rule: the prefill side computes all N and samples the first
token; nothing is recomputed on the decode side):

    prompt_ids [N], first_token        the tokens; the decode side's first step decodes first_token
    params, max_tokens                 sampling parameters and the cap the prefill side applied
    generator_state  uint8 [G]         the request's torch.Generator after the first draw
    logprobs, prompt_logprobs          what params.logprobs / prompt_logprobs recorded so far
    dsa_latent  uint8 [L_dsa, N, E_l]  per DSA layer and token, the latent + rope entry as stored
    dsa_index   uint8 [L_dsa, N, E_i]  per DSA layer and token, the index key (+ scales) as stored
    kda_state   fp32  [L_kda, H, d_k, d_v]      every KDA layer's recurrent state after token N
    kda_conv    [L_kda, channels, kernel - 1]   and its conv tail, in the model's compute dtype (both as
                                                memory.state_dtype's slot formats store them: bf16, int8 bytes)
    mtp_hidden  [1, hidden]                     the target's hidden row at position N - 1, compute dtype, where
                                                the model has an MTP head ([0, hidden] without): the decode
                                                side's MTP drafter starts from it (serving/spec/hidden_rows.py)
    identity                           the weights' fingerprint and the cache formats

Heads are always whole here: a tensor-parallel prefill gathers its ranks' KDA heads before they travel
(transfer.py), so any decode layout reads the same set.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

import torch

from latentmoe_lab.ops.state_quant import decode_rows
from latentmoe_lab.quant.kda_state import FEEDBACK_BITS
from latentmoe_lab.serving.cache_tiers.spill_disk import tensors_sha256
from latentmoe_lab.serving.logprobs import TokenLogprob
from latentmoe_lab.serving.sampling import SamplingParams
from latentmoe_lab.serving.transport.transfer_bytes import payload_shapes

POOL_FIELDS = ("dsa_latent", "dsa_index", "kda_state", "kda_conv")  # the rows read_rows / write_rows move
TENSOR_FIELDS = ("generator_state", *POOL_FIELDS, "mtp_hidden")
# The delta rule keeps a KDA state within about sqrt(N) times its largest value (unit keys, beta < 1, decay
# <= 1), and a working model's values are far below this; a state past it is garbage, not a long prompt.
MAX_STATE_ABS = 1e6


@dataclass(frozen=True)
class CacheIdentity:
    """model: fingerprint of the model config and weights; cache_dtype: the DSA pools' storage format
    (memory.kv_cache_dtype resolved); model_dtype: the compute dtype (conv tails), as in the service YAML;
    state_dtype: the KDA slots' format (memory.state_dtype)."""

    model: str
    cache_dtype: str
    model_dtype: str
    state_dtype: str = "fp32"

    KEYS = (("model", "model (the checkpoint: weights and config)"), ("cache_dtype", "memory.kv_cache_dtype"),
            ("model_dtype", "model.dtype"), ("state_dtype", "memory.state_dtype"))


def check_compatible(expected: CacheIdentity, got: CacheIdentity) -> None:
    """ValueError naming the key when a cache written as `got` cannot enter pools of identity `expected`."""
    for attribute, key in CacheIdentity.KEYS:
        mine, theirs = getattr(expected, attribute), getattr(got, attribute)
        if mine != theirs:
            raise ValueError(f"{key}: the transfer was written by an instance with {theirs!r}, this instance "
                             f"has {mine!r}; prefill and decode instances must serve the same model and formats")


def model_fingerprint(model) -> str:
    """SHA-256 of the model's config and every tensor of its state (tensors_sha256: names, dtypes, shapes, bytes)."""
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(f"{config}|{tensors_sha256(model.state_dict())}".encode()).hexdigest()


def engine_identity(engine) -> CacheIdentity:
    """The CacheIdentity of an Engine's pools, kept on the engine (the fingerprint computed once per engine)."""
    if engine.cache_identity is None:
        engine.cache_identity = CacheIdentity(model_fingerprint(engine.runner.model), engine.config.cache_dtype,
                                              engine.config.compute_dtype, engine.config.memory.state_dtype)
    return engine.cache_identity


@dataclass
class RequestCache:
    request_id: int  # on the side that wrote it (the prefill engine's id)
    prompt_ids: list[int]
    first_token: int
    params: SamplingParams
    max_tokens: int
    identity: CacheIdentity
    generator_state: torch.Tensor
    dsa_latent: torch.Tensor
    dsa_index: torch.Tensor
    kda_state: torch.Tensor
    kda_conv: torch.Tensor
    mtp_hidden: torch.Tensor
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    def pool_rows(self) -> dict[str, torch.Tensor]:
        """The rows a runner's write_rows stores (the hidden row stays in the engine's process)."""
        return {name: getattr(self, name) for name in POOL_FIELDS}

    def tensor_bytes(self) -> int:
        """Bytes of the payload's tensors: what bytes_per_request plans."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def check(self, model_config) -> None:
        """ValueError naming the field unless every tensor has the shape and dtype `model_config` and the
        identity's formats give for N = len(prompt_ids) tokens, and the token ids are in the vocabulary."""
        if not self.prompt_ids:
            raise ValueError("prompt_ids: a transfer needs at least one prompt token")
        vocab = model_config.vocab_size
        for name, ids in (("prompt_ids", self.prompt_ids), ("first_token", [self.first_token])):
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"{name}: token ids must be integers in [0, vocab_size={vocab})")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        identity = self.identity
        expected = payload_shapes(model_config, self.num_tokens, identity.cache_dtype, identity.model_dtype,
                                  identity.state_dtype)
        for name, (shape, dtype) in expected.items():
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{name}: expected {shape} {dtype} for {self.num_tokens} tokens, got {got}")
        self.check_values(vocab)

    def check_values(self, vocab: int) -> None:
        """What a checksum cannot vouch for (a buggy sender signs its garbage too): logprobs are numbers <= 0 of
        ids in the vocabulary, the KDA state, conv tails and MTP hidden row are finite and within MAX_STATE_ABS,
        and the generator state is one torch accepts. ValueError naming the field."""
        for name in ("logprobs", "prompt_logprobs"):
            for lp in getattr(self, name):
                pairs = ((lp.token_id, lp.logprob), *lp.top)
                if any(not 0 <= t < vocab or math.isnan(v) or v > 0 for t, v in pairs):
                    raise ValueError(f"{name}: a logprob must be a number <= 0 of a token id in [0, {vocab}), "
                                     f"got {lp}")
        for name in ("kda_state", "kda_conv", "mtp_hidden"):
            values = self.stored_values(name)
            if values.numel() and not (values.isfinite().all() and values.abs().max() <= MAX_STATE_ABS):
                raise ValueError(f"{name}: values must be finite and at most {MAX_STATE_ABS:g} in magnitude "
                                 f"(largest {values.abs().max().item():g})")
        try:
            torch.Generator().set_state(self.generator_state.clone())
        except RuntimeError as error:
            raise ValueError(f"generator_state: not a state torch's generator takes ({error})") from None

    def stored_values(self, name: str) -> torch.Tensor:
        """A tensor's values in fp32: KDA rows that memory.state_dtype int8 stores as bytes decoded (the state's
        rows with their residual, the conv tail's without: quant/kda_state.py)."""
        stored = getattr(self, name)
        if stored.is_floating_point():
            return stored.float()
        return decode_rows(stored, FEEDBACK_BITS if name == "kda_state" else 0)

    def header(self) -> dict:
        """Everything but the tensors, as JSON-ready values (the wire header's "request" entry)."""
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids), "first_token": self.first_token,
                "params": asdict(self.params), "max_tokens": self.max_tokens, "identity": asdict(self.identity),
                "logprobs": [asdict(lp) for lp in self.logprobs],
                "prompt_logprobs": [asdict(lp) for lp in self.prompt_logprobs]}

    @classmethod
    def from_header(cls, header: dict, tensors: dict[str, torch.Tensor]) -> "RequestCache":
        """The inverse of header(): ValueError / TypeError naming the field on anything malformed."""
        params = dict(header["params"])
        params["stop_token_ids"] = tuple(params.get("stop_token_ids", ()))
        params["logit_bias"] = tuple(tuple(pair) for pair in params.get("logit_bias", ()))
        return cls(request_id=header["request_id"], prompt_ids=list(header["prompt_ids"]),
                   first_token=header["first_token"], params=SamplingParams(**params),
                   max_tokens=header["max_tokens"], identity=CacheIdentity(**header["identity"]),
                   logprobs=[_logprob(lp) for lp in header["logprobs"]],
                   prompt_logprobs=[_logprob(lp) for lp in header["prompt_logprobs"]], **tensors)


def _logprob(data: dict) -> TokenLogprob:
    return TokenLogprob(int(data["token_id"]), float(data["logprob"]),
                        tuple((int(t), float(v)) for t, v in data.get("top", ())))
