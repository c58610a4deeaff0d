"""Model loading and generation; knows nothing of HTTP."""

from .core import Engine, EngineOverloaded, EngineUnavailable
from .events import Event, EventSource, Failed, Finished, Generation, PromptLogprobs, Started, TextDelta
from .grammar import GrammarRefused, json_schema_grammar, tool_call_grammar
from .loading import ModelNotFound
from .sampling import SamplingParams
from .template import TemplateRefused
from .text import TokenLogprob

__all__ = [
    "Engine",
    "EngineOverloaded",
    "EngineUnavailable",
    "Event",
    "EventSource",
    "Failed",
    "Finished",
    "Generation",
    "GrammarRefused",
    "ModelNotFound",
    "PromptLogprobs",
    "SamplingParams",
    "Started",
    "TemplateRefused",
    "TextDelta",
    "TokenLogprob",
    "json_schema_grammar",
    "tool_call_grammar",
]
