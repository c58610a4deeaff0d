"""Model loading and generation; knows nothing of HTTP."""

from .core import (
    Engine,
    EngineOverloaded,
    EngineUnavailable,
    Failed,
    Finished,
    Generation,
    Started,
    TemplateRefused,
    TextDelta,
    events_until_last,
)
from .grammar import GrammarRefused, json_schema_grammar, tool_call_grammar
from .loading import ModelNotFound
from .sampling import SamplingParams
from .text import TokenLogprob

__all__ = [
    "Engine",
    "EngineOverloaded",
    "EngineUnavailable",
    "Failed",
    "Finished",
    "Generation",
    "GrammarRefused",
    "ModelNotFound",
    "SamplingParams",
    "Started",
    "TemplateRefused",
    "TextDelta",
    "TokenLogprob",
    "events_until_last",
    "json_schema_grammar",
    "tool_call_grammar",
]
