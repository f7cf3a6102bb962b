"""Measuring the package's own computations: peak tensor memory (more tools will live here)."""
from latentmoe_lab.profiling.memory import PeakMemory

__all__ = ["PeakMemory"]
