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
from .loading import ModelNotFound
from .sampling import SamplingParams

__all__ = [
    "Engine",
    "EngineOverloaded",
    "EngineUnavailable",
    "Failed",
    "Finished",
    "Generation",
    "ModelNotFound",
    "SamplingParams",
    "Started",
    "TemplateRefused",
    "TextDelta",
    "events_until_last",
]
