"""FreeToken: a tensor-parallel LLM inference engine."""

from freetoken.engine.driver import LLMClosed
from freetoken.engine.llm import LLM
from freetoken.engine.sequence import GenerationResult, SamplingParams

__all__ = ["LLM", "LLMClosed", "GenerationResult", "SamplingParams"]
