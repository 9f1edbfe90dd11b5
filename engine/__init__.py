"""The pdserve engine core shared by the prefill and decode services."""
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidRequestError"]
