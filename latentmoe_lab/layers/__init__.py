"""nn.Modules of the model: attention (KDA, Gated DSA), FFNs (dense SwiGLU, LatentMoE), norms, vision tower."""
from latentmoe_lab.layers.dsa import GatedDSA
from latentmoe_lab.layers.dsa_indexer import LightningIndexer
from latentmoe_lab.layers.ffn import SwiGLU
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.layers.moe import Dispatcher, LatentExperts, LatentMoE, LocalDispatcher
from latentmoe_lab.layers.norm import RMSNorm
from latentmoe_lab.layers.packed import sequence_start_from_cu_seqlens
from latentmoe_lab.layers.vision import VisionTower

__all__ = ["GatedDSA", "LightningIndexer", "SwiGLU", "KimiDeltaAttention", "Dispatcher", "LatentExperts",
           "LatentMoE", "LocalDispatcher", "RMSNorm", "sequence_start_from_cu_seqlens", "VisionTower"]
