"""Model loading and generation; knows nothing of HTTP.

Names are re-exported lazily (PEP 562): importing a torch-free submodule such as `.cores`, as
Gunicorn's master does, must not run `.core` and with it torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import Engine, EngineOverloaded, EngineUnavailable
    from .events import (
        ChoiceEvent,
        ChoiceGroup,
        Event,
        EventSource,
        Failed,
        Finished,
        Generation,
        KvScope,
        PromptLogprobs,
        Started,
        TextDelta,
    )
    from .grammar import (
        GrammarRefused,
        choice_grammar,
        gbnf_grammar,
        json_schema_grammar,
        lark_grammar,
        regex_grammar,
        text_or_tool_call_grammar,
        tool_call_grammar,
    )
    from .loading import ModelNotFound
    from .sampling import SamplingParams, choice_seed
    from .template import ReasoningMarkers, TemplateRefused
    from .text import TokenLogprob

# Each public name and the submodule that defines it.
_EXPORTS = {
    "ChoiceEvent": ".events",
    "ChoiceGroup": ".events",
    "Engine": ".core",
    "EngineOverloaded": ".core",
    "EngineUnavailable": ".core",
    "Event": ".events",
    "EventSource": ".events",
    "Failed": ".events",
    "Finished": ".events",
    "Generation": ".events",
    "GrammarRefused": ".grammar",
    "KvScope": ".events",
    "ModelNotFound": ".loading",
    "PromptLogprobs": ".events",
    "ReasoningMarkers": ".template",
    "SamplingParams": ".sampling",
    "Started": ".events",
    "TemplateRefused": ".template",
    "TextDelta": ".events",
    "TokenLogprob": ".text",
    "choice_grammar": ".grammar",
    "choice_seed": ".sampling",
    "gbnf_grammar": ".grammar",
    "json_schema_grammar": ".grammar",
    "lark_grammar": ".grammar",
    "regex_grammar": ".grammar",
    "text_or_tool_call_grammar": ".grammar",
    "tool_call_grammar": ".grammar",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import a re-exported name from its submodule on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """List the module's names with the lazily re-exported ones."""
    return sorted([*globals(), *_EXPORTS])
