"""Quantization (docs/design.md §7): KV-cache codecs for the paged pools, packed weight formats, W8A8
activation simulation and calibration, exact byte accounting, quantized checkpoints.

    kv_formats(config, kv_cache_dtype) -> (latent_format, index_format)   storage formats for PagedPools
    kv_bytes_per_token(config, kv_cache_dtype) -> {"mla": B, "index": B}  per token per DSA layer
    quantized_kv_cache(config, kv_cache_dtype)                            the contiguous twin (HybridCache)
    quantize_model(model, recipe, batches=None)                           in place; named recipes in RECIPES
    calibrate(model, batches, method)                                     static activation scales
    save_quantized(model, dir) / load_quantized(dir)                      quant/checkpoint.py
Byte counts of a recipe without building anything: latentmoe_lab.meta.recipe_bytes.
"""
from latentmoe_lab.quant.calibration import calibrate
from latentmoe_lab.quant.checkpoint import load_quantized, save_quantized
from latentmoe_lab.quant.experts import QuantLatentExperts
from latentmoe_lab.quant.kv import KV_CACHE_DTYPES, kv_bytes_per_token, kv_formats
from latentmoe_lab.quant.kv_cache import quantized_kv_cache
from latentmoe_lab.quant.linear import QuantLinear
from latentmoe_lab.quant.quantize import held_bytes, quantize_model
from latentmoe_lab.quant.recipes import RECIPES, Recipe, get_recipe

__all__ = ["KV_CACHE_DTYPES", "QuantLatentExperts", "QuantLinear", "RECIPES", "Recipe", "calibrate", "get_recipe",
           "held_bytes", "kv_bytes_per_token", "kv_formats", "load_quantized", "quantize_model", "quantized_kv_cache",
           "save_quantized"]
