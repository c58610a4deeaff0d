"""Model loading and generation; knows nothing of HTTP."""

from .core import Engine, EngineOverloaded, EngineUnavailable
from .events import ChoiceEvent, ChoiceGroup, Event, EventSource, Failed, Finished, Generation, PromptLogprobs, Started, TextDelta
from .grammar import GrammarRefused, json_schema_grammar, text_or_tool_call_grammar, tool_call_grammar
from .loading import ModelNotFound
from .sampling import SamplingParams, choice_seed
from .template import TemplateRefused
from .text import TokenLogprob

__all__ = [
    "ChoiceEvent",
    "ChoiceGroup",
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
    "choice_seed",
    "json_schema_grammar",
    "text_or_tool_call_grammar",
    "tool_call_grammar",
]
