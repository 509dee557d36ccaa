"""Looped LMs (Ouro, LoopFormer, Parcae) behind one :class:`LoopLM` interface."""

from loopq.models.base import LinearGroup, LoopLM, LoopLMError, LoopLMOutput
from loopq.models.loading import architectures, load_looplm

__all__ = ["LinearGroup", "LoopLM", "LoopLMError", "LoopLMOutput", "architectures", "load_looplm"]
