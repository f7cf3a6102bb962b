"""Speculative decoding (docs/design.md §12): drafters that propose K tokens per request, and their config."""
from latentmoe_lab.serving.spec.drafters import DraftInput, Drafter, NgramDrafter, ngram_proposal
from latentmoe_lab.serving.spec.mtp_batched import BatchedMTPDrafter
from latentmoe_lab.serving.spec.mtp_drafter import MTPDrafter

__all__ = ["BatchedMTPDrafter", "DraftInput", "Drafter", "MTPDrafter", "NgramDrafter", "ngram_proposal"]
