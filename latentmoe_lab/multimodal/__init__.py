"""Native multimodal token mixing (docs/design.md §1.5): images + text -> one sequence, and what that changes.

    processor      ImageTextProcessor: "<image>" markers + images -> input_ids, pixel_values, image_grids
    images         load / check / resize / patchify one image
    packing        padded and packed (cu_seqlens) layouts of a mixed batch
    synthetic      procedural shapes, colours and digits with questions about them
    training       a tiny visual question answering run (loss curve, accuracy vs chance)
    routing_stats  expert load split by text and image tokens
    cost           tokens, cache bytes and tower FLOPs per image size
    chunking       chunked-prefill boundaries that keep image spans whole
"""
from latentmoe_lab.multimodal.chunking import image_spans, images_in_chunk, prefill_chunks, select_images
from latentmoe_lab.multimodal.cost import ImageCost, cache_bytes_per_token, image_cost, image_cost_table
from latentmoe_lab.multimodal.images import grid_size, patchify, to_image_tensor, tokens_for_image, unpatchify
from latentmoe_lab.multimodal.packing import pack, padding_fraction, unpack, unpad
from latentmoe_lab.multimodal.processor import IMAGE_MARKER, ImageTextProcessor, MultimodalBatch
from latentmoe_lab.multimodal.routing_stats import ModalityRouting, routing_by_modality
from latentmoe_lab.multimodal.synthetic import SyntheticSample, chance_accuracy, make_sample, make_samples
from latentmoe_lab.multimodal.training import TrainingResult, answer_accuracy, answer_predictions, train_vqa

__all__ = [
    "image_spans", "images_in_chunk", "prefill_chunks", "select_images", "ImageCost", "cache_bytes_per_token",
    "image_cost", "image_cost_table", "grid_size", "patchify", "to_image_tensor", "tokens_for_image", "unpatchify",
    "pack", "padding_fraction", "unpack", "unpad", "IMAGE_MARKER", "ImageTextProcessor", "MultimodalBatch",
    "ModalityRouting", "routing_by_modality", "SyntheticSample", "chance_accuracy", "make_sample", "make_samples",
    "TrainingResult", "answer_accuracy", "answer_predictions", "train_vqa",
]
