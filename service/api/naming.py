"""The names the served model answers to, and the 404 for any other."""

from ..errors import NotFound
from ..settings import Settings


def resolve_model_name(settings: Settings, requested: str | None) -> str:
    """Return the name a reply carries for the model a request named (the default when it named none),
    or raise 404 `model_not_found` listing the accepted names."""
    if not requested:
        return settings.served_model_name
    names = settings.served_model_names
    if requested not in names:
        raise NotFound(
            f"the model '{requested}' does not exist; this server serves " + ", ".join(f"'{name}'" for name in names),
            param="model",
            code="model_not_found",
        )
    return requested
