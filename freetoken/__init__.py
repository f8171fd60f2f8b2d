"""FreeToken: a tensor-parallel LLM inference engine."""

from freetoken.engine.llm import LLM
from freetoken.engine.sequence import GenerationResult, SamplingParams

__all__ = ["LLM", "GenerationResult", "SamplingParams"]
