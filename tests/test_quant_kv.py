"""KV-cache codecs (docs/design.md §7): error bounds, exact bytes, the block-planar layout, attention and the
indexer over decoded fp8 values, and the paged forward with quantized pools."""
import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig, quant
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.ops.sparse_attention import index_scores, select_topk, sparse_attention
from latentmoe_lab.paged_pools import PagedPools
from latentmoe_lab.quant.kv import KV_CACHE_DTYPES, kv_bytes_per_token, kv_formats
from latentmoe_lab.quant.kv_cache import quantized_kv_cache
from latentmoe_lab.quant.kv_index import QuantizedIndexFormat
from latentmoe_lab.quant.kv_mla import QuantizedLatentFormat


def _values(n, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    x[:, 3] *= 30  # an outlier channel, as RMSNorm outputs have
    x[0] = 0  # an all-zero token
    return x


def _round_trip(fmt, values, block_size=16, num_blocks=5):
    storage = fmt.allocate(num_blocks, block_size, values.shape[1], None)
    positions = torch.randperm(num_blocks * block_size)[:values.shape[0]]
    fmt.write(storage, positions, values)
    return fmt.read(storage, positions), storage, positions


@pytest.mark.parametrize("dim", [128, 200, 16])  # multiple of 128, ragged (128 + 72), the tiny preset's width
@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_group_codecs_round_trip_within_their_bounds(dim, dtype):
    values = _values(60, dim)
    decoded, _, _ = _round_trip(QuantizedIndexFormat(dim, dtype), values)
    groups = -(-dim // 128)
    padded = torch.nn.functional.pad(values, (0, groups * 128 - dim)).view(60, groups, 128)
    qmax = 448.0 if dtype == "fp8" else 127.0
    scale = (padded.abs().amax(-1) / qmax).repeat_interleave(128, -1)[:, :dim]  # the stated group rule
    err = (decoded - values).abs()
    if dtype == "fp8":
        normal = values.abs() >= 2 ** -6 * scale  # relative error <= 2^-4 once scaled into e4m3's normals
        assert bool((err[normal] <= 2 ** -4 * values.abs()[normal]).all())
        assert bool((err[~normal] <= 2 ** -10 * scale[~normal]).all())
    else:
        assert bool((err <= scale / 2 * (1 + 1e-6)).all())
    assert torch.equal(decoded[values.eq(0).all(-1)], values[values.eq(0).all(-1)])


def test_mla_entry_keeps_rope_in_bf16_and_quantizes_the_latent():
    fmt = QuantizedLatentFormat(512, 64, "fp8")
    values = _values(40, 576)
    decoded, _, _ = _round_trip(fmt, values)
    assert torch.equal(decoded[:, 512:], values[:, 512:].bfloat16().float())
    assert float((decoded[:, :512] - values[:, :512]).abs().max()) <= 2 ** -4 * float(values[:, :512].abs().max())


def test_exact_bytes_per_token():
    k3, tiny = ModelConfig.from_preset("k3-2.8t"), ModelConfig.from_preset("tiny")
    assert quant.kv_bytes_per_token(k3, "fp8") == {"mla": 656, "index": 132}  # 512 + 4*4 + 64*2; 128 + 4
    assert kv_bytes_per_token(k3, "int8") == {"mla": 656, "index": 132}
    assert kv_bytes_per_token(k3, "bf16") == kv_bytes_per_token(k3, "auto") == {"mla": 1152, "index": 256}
    assert kv_bytes_per_token(k3, "fp32") == {"mla": 2304, "index": 512}
    assert kv_bytes_per_token(k3, "auto", model_dtype="fp32") == {"mla": 2304, "index": 512}
    assert kv_bytes_per_token(tiny, "fp8") == {"mla": 16 + 4 + 16, "index": 16 + 4}  # one (smaller) group
    for dtype in KV_CACHE_DTYPES:
        latent, index = kv_formats(tiny, dtype)
        for fmt, dim in ((latent, 24), (index, 16)):
            storage = fmt.allocate(3, 8, dim, None)
            assert storage.numel() * storage.element_size() == 3 * 8 * fmt.bytes_per_token(dim)
            expected = {"fp8": torch.uint8, "int8": torch.uint8, "fp32": torch.float32, "fp16": torch.float16}
            assert storage.dtype == expected.get(dtype, torch.bfloat16)  # auto = bf16 by default
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        kv_formats(tiny, "fp4")


def test_index_layout_is_block_planar_in_raw_bytes():
    fmt, block_size, dim = QuantizedIndexFormat(128, "fp8"), 4, 128
    storage = fmt.allocate(3, block_size, dim, None)
    assert storage.shape == (3, block_size * 132)
    keys = torch.randn(2, dim)
    position = torch.tensor([1 * block_size + 2, 2 * block_size + 0])  # block 1 offset 2, block 2 offset 0
    fmt.write(storage, position, keys)
    scale = keys.abs().amax(-1) / 448
    codes = (keys / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    values_end = block_size * dim  # a block: all its block_size x 128 values, then its block_size scales
    assert torch.equal(storage[1, 2 * dim:3 * dim], codes[0])
    assert torch.equal(storage[1, values_end + 4 * 2:values_end + 4 * 3].view(torch.float32), scale[:1])
    assert torch.equal(storage[2, :dim], codes[1])
    assert torch.equal(storage[2, values_end:values_end + 4].view(torch.float32), scale[1:])
    assert int(storage[0].count_nonzero()) == 0 and int(storage[1, :2 * dim].count_nonzero()) == 0
    # A token-interleaved reader (value-scale pairs per token) would decode garbage from the same bytes.
    interleaved = storage[1, 2 * 132:3 * 132]
    wrong = interleaved[:dim].view(torch.float8_e4m3fn).float() * interleaved[dim:].contiguous().view(torch.float32)
    assert not torch.allclose(wrong, fmt.read(storage, position[:1])[0], atol=0.1)


def test_bad_arguments_name_the_rule():
    fmt = QuantizedIndexFormat(16)
    storage = fmt.allocate(2, 4, 16, None)
    with pytest.raises(ValueError, match=r"positions: positions must lie in \[0, .* = 8\)"):
        fmt.read(storage, torch.tensor([8]))
    with pytest.raises(ValueError, match="values: expected shape"):
        fmt.write(storage, torch.tensor([0]), torch.randn(1, 15))
    with pytest.raises(ValueError, match="dim: this format holds kv_lora 16"):
        QuantizedLatentFormat(16, 8).bytes_per_token(16)
    with pytest.raises(ValueError, match="storage: expected uint8"):
        fmt.read(torch.zeros(2, 80), torch.tensor([0]))
    with pytest.raises(TypeError, match="slot_mapping: expected an integer dtype"):
        fmt.write(storage, torch.tensor([0.0]), torch.randn(1, 16))


def _cache_round_trip(fmt, values):
    storage = fmt.allocate(-(-values.shape[0] // 16), 16, values.shape[1], None)
    positions = torch.arange(values.shape[0])
    fmt.write(storage, positions, values)
    return fmt.read(storage, positions)


def test_indexer_and_sparse_attention_over_an_fp8_cache_stay_near_fp32():
    """k3-2.8t widths (latent 512 + rope 64, d_I 128), 256 cached tokens, 8 queries, top-64."""
    g = torch.Generator().manual_seed(1)
    keys, queries, topk = 256, 8, 64
    latent_rope = _values(keys, 576, seed=2)
    index_keys = torch.nn.functional.layer_norm(torch.randn(1, keys, 128, generator=g), (128,))[0]
    q_idx, w = torch.randn(1, queries, 4, 128, generator=g), torch.rand(1, queries, 4, generator=g)
    latent_format, index_format = QuantizedLatentFormat(512, 64, "fp8"), QuantizedIndexFormat(128, "fp8")
    cached_keys = _cache_round_trip(index_format, index_keys)
    ref_scores = index_scores(q_idx, index_keys[None], w)
    fp8_scores = index_scores(q_idx, cached_keys[None], w)
    offset = keys - queries
    ref_sel, fp8_sel = select_topk(ref_scores, topk, offset), select_topk(fp8_scores, topk, offset)
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ref_sel[0], fp8_sel[0])) / (queries * topk)
    score_err = float((fp8_scores - ref_scores).abs().max() / ref_scores.abs().max())

    q = torch.randn(1, queries, 4, 576, generator=g)
    cached = _cache_round_trip(latent_format, latent_rope)
    k_ref, k_fp8 = latent_rope[None, :, None], cached[None, :, None]
    ref = sparse_attention(q, k_ref, k_ref[..., :512], ref_sel, scale=576 ** -0.5)
    out = sparse_attention(q, k_fp8, k_fp8[..., :512], ref_sel, scale=576 ** -0.5)
    attn_err = float((out - ref).abs().max() / ref.abs().max())
    # Stated tolerances (max error relative to the largest value): 5%. e4m3 keeps 2^-4 per element, and
    # dot products of many such errors partly cancel.
    assert score_err < 0.05 and attn_err < 0.05 and overlap >= 0.9, (
        f"[fp8 KV] index score rel err {score_err:.4f}, top-{topk} overlap {overlap:.3f}, "
        f"sparse attention rel err {attn_err:.4f}")


def _paged_greedy(model, formats, prompt, new_tokens, block_size=8):
    pools = PagedPools(model.config, num_blocks=16, block_size=block_size, num_slots=1,
                       latent_format=formats[0], index_format=formats[1])
    table = list(range(pools.num_blocks))
    tokens, context, logits_seen = list(prompt), 0, []
    with torch.no_grad():
        for step in range(new_tokens):
            new = tokens[context:]
            blocks = table[:-(-(context + len(new)) // block_size)]
            batch = ForwardBatch.from_sequences(new_tokens=[new], context_lens=[context], block_tables=[blocks],
                                                state_slots=[0], block_size=block_size)
            logits = model(batch.input_ids, batch=batch, pools=pools).logits[0]
            logits_seen.append(logits)
            context += len(new)
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], torch.stack(logits_seen), pools


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_paged_forward_with_quantized_pools_runs_and_stays_near_bf16(dtype):
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny")
    model = LatentMoEForCausalLM(config).eval()
    prompt = torch.randint(0, 250, (40,)).tolist()  # longer than the indexer's top-32
    ref_tokens, ref_logits, _ = _paged_greedy(model, kv_formats(config, "bf16"), prompt, 6)
    tokens, logits, pools = _paged_greedy(model, kv_formats(config, dtype), prompt, 6)
    per_token = kv_bytes_per_token(config, dtype)
    assert pools.nbytes()["dsa_latent"] == config.num_dsa_layers * 16 * 8 * per_token["mla"]
    assert pools.nbytes()["dsa_index"] == config.num_dsa_layers * 16 * 8 * per_token["index"]
    agreement = sum(a == b for a, b in zip(tokens, ref_tokens)) / len(tokens)
    err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
    assert err < 0.1, (f"[{dtype} KV, tiny random model] greedy agreement with bf16 KV {agreement:.2f}, "
                       f"logits rel err {err:.4f}")


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_paged_quantized_pools_equal_their_contiguous_codec_twin(dtype):
    """Greedy decoding over quantized paged pools == over a HybridCache that round-trips through the codecs."""
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny")
    model = LatentMoEForCausalLM(config).eval()
    prompt = torch.randint(0, 250, (40,)).tolist()
    tokens, logits, _ = _paged_greedy(model, kv_formats(config, dtype), prompt, 5)
    cache, ids, twin = quantized_kv_cache(config, dtype), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(5):
            step = model(ids if not twin else ids[:, -1:], cache=cache).logits[0, -1]
            twin.append(step)
            ids = torch.cat([ids, step.argmax().view(1, 1)], dim=1)
    assert tokens == ids[0, len(prompt):].tolist()
    torch.testing.assert_close(logits, torch.stack(twin), atol=1e-5, rtol=1e-5)
