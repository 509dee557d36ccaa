"""LoopQ: loop-aware post-training quantization of looped language models."""

__version__ = "0.1.0"
