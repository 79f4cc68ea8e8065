"""spmoe: GLM-5.2 / DeepSeek-V3.2 with TP attention, EP experts and sequence-parallel MoE."""

__version__ = "0.1.0"
