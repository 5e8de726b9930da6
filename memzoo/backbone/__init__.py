"""The hybrid backbone: token mixers (GDN, SWA, FA), blocks, layout strings, HybridLM."""

from memzoo.layout import Layout, LayoutError, parse_layout
from memzoo.backbone.model import HybridLM, MemzooConfig, MemzooOutput, count_params

__all__ = ["HybridLM", "Layout", "LayoutError", "MemzooConfig", "MemzooOutput", "count_params", "parse_layout"]
