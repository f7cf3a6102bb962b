"""Accuracy alignment: compare any candidate with the reference tap by tap (docs/design.md §8).

    taps        named forward hooks (embeddings, attention / FFN / residual per block, router, norm, logits)
    metrics     cosine, relative L2, rel_diff, SQNR, max abs error; routing flips; KL, top-1, bits per byte
    compare     compare(reference, candidate, inputs) -> AlignmentReport (table, first divergence, figure, HTML)
    candidates  another dtype, a quantization recipe, another backend, an N-rank layout, the serving engine
    bisect      swap single layers to find the one that causes the final error
    cli         `latentmoe-lab align`
"""
from latentmoe_lab.alignment.bisect import BisectResult, bisect_layers
from latentmoe_lab.alignment.candidates import (BackendCandidate, EngineCandidate, ParallelCandidate, cast_candidate,
                                                forced_backend, quantized_candidate)
from latentmoe_lab.alignment.compare import THRESHOLDS, AlignmentReport, TapRow, compare, compare_recordings, record
from latentmoe_lab.alignment.taps import ExpertChoice, Recording, TapPoint, TokenSubset, record_taps, tap_points

__all__ = ["AlignmentReport", "BackendCandidate", "BisectResult", "EngineCandidate", "ExpertChoice", "ParallelCandidate", "Recording",
           "THRESHOLDS", "TapPoint", "TapRow", "TokenSubset", "bisect_layers", "cast_candidate", "compare",
           "compare_recordings", "forced_backend", "quantized_candidate", "record", "record_taps", "tap_points"]
