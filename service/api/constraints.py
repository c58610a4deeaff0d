"""The one grammar a reply follows, from whichever request field asks for it: vLLM's `structured_outputs`,
llama.cpp's `grammar`, `response_format`, a forced tool call or strict tools under `auto`.

A reply follows one grammar, so a request that asks for two is a 400 naming the second; every grammar is
checked here, in the request thread, so a malformed one is a 400 naming its field, not a failed generation.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine import (
    GrammarRefused,
    choice_grammar,
    gbnf_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
    text_or_tool_call_grammar,
    tool_call_grammar,
)
from ..errors import InvalidRequest
from . import nesting
from .chat_parts import GrammarFields, StructuredOutputs
from .chat_request import ChatCompletionRequest

if TYPE_CHECKING:
    from ..engine.template import ChatTemplate


@dataclass(frozen=True)
class Constraint:
    """A grammar the reply must follow, and the request field it came from (which errors about it name)."""

    grammar: str
    param: str


def grammar_field_constraint(request: GrammarFields) -> Constraint | None:
    """Return the constraint of `structured_outputs` or `grammar`, or None when the request gives neither."""
    if request.structured_outputs is not None and request.grammar is not None:
        raise InvalidRequest("'grammar' cannot be combined with 'structured_outputs': a reply follows one grammar",
                             param="grammar")
    if request.grammar is not None:
        return _enforced("grammar", "the GBNF grammar", lambda: gbnf_grammar(request.grammar))
    if request.structured_outputs is not None:
        return _structured_outputs(request.structured_outputs)
    return None


def _structured_outputs(given: StructuredOutputs) -> Constraint:
    """Return the constraint of the one key `structured_outputs` gives."""
    if given.choice is not None:
        return _enforced("structured_outputs.choice", "the choices", lambda: choice_grammar(given.choice))
    if given.regex is not None:
        return _enforced("structured_outputs.regex", "the regex", lambda: regex_grammar(given.regex))
    if given.grammar is not None:
        return _enforced("structured_outputs.grammar", "the Lark grammar", lambda: lark_grammar(given.grammar))
    schema = given.json_
    if isinstance(schema, str):
        try:
            schema = nesting.loads(schema)
        except ValueError as exc:  # nesting.TooDeep is a ValueError too
            raise InvalidRequest(f"invalid 'structured_outputs.json': not a JSON schema: {exc}",
                                 param="structured_outputs.json") from None
        if not isinstance(schema, dict):
            raise InvalidRequest("invalid 'structured_outputs.json': a schema must be a JSON object",
                                 param="structured_outputs.json")
    return _enforced("structured_outputs.json", "the schema", lambda: json_schema_grammar(schema))


def _enforced(param: str, what: str, build: Callable[[], str]) -> Constraint:
    """Build a grammar with `build`, or raise the 400 naming `param` with the grammar engine's reason."""
    try:
        return Constraint(build(), param)
    except GrammarRefused as exc:
        raise InvalidRequest(f"invalid '{param}': {what} cannot be enforced: {exc}", param=param) from None


def chat_constraint(request: ChatCompletionRequest, template: "ChatTemplate") -> Constraint | None:
    """Return the grammar a chat reply must follow (a grammar field, strict tools' calls under `auto`, a forced
    tool call, or response_format), or None for free text."""
    requested = grammar_field_constraint(request)
    if requested is not None:
        other = _tool_or_format_constraint(request)
        if other is not None:
            field = requested.param.split(".")[0]
            raise InvalidRequest(f"'{field}' cannot be combined with {other}: a reply follows one grammar",
                                 param=field)
        return requested
    if request.strict_tools_under_auto:
        return _strict_auto_constraint(request, template)
    if request.forced_tools:
        functions = [(tool.function.name, tool.function.arguments_schema) for tool in request.forced_tools]
        # A named tool_choice asks for that one call, and the reply ends after it, as OpenAI's does.
        parallel = request.parallel_tool_calls is not False and request.effective_tool_choice == "required"
        return _enforced("tools", "their parameters", lambda: tool_call_grammar(functions, parallel=parallel))
    if request.json_schema is not None:
        return _enforced("response_format", "the schema", lambda: json_schema_grammar(request.json_schema))
    return None


def _tool_or_format_constraint(request: ChatCompletionRequest) -> str | None:
    """Name the other field that constrains the reply (a forced tool call, strict tools, a JSON format), or None."""
    if request.forced_tools:
        return "a tool_choice that forces a tool call"
    if request.strict_tools_under_auto:
        return "strict tools under tool_choice 'auto'"
    if request.json_schema is not None:
        return f"response_format '{request.response_format.type}'"
    return None


def _strict_auto_constraint(request: ChatCompletionRequest, template: "ChatTemplate") -> Constraint:
    """Return the grammar of text or tool calls in which every strict tool's arguments follow its schema."""
    if request.json_schema is not None:
        raise InvalidRequest("'response_format' cannot be combined with strict tools under tool_choice 'auto'",
                             param="response_format")
    markers = template.tool_call_marker_ids
    if markers is None:
        raise InvalidRequest("strict tools cannot be enforced: the model's tokenizer has no tool-call tokens",
                             param="tools")
    functions = [
        (tool.function.name, tool.function.arguments_schema if tool.function.strict else {"type": "object"})
        for tool in request.tools_offered
    ]
    parallel = request.parallel_tool_calls is not False
    return _enforced("tools", "their parameters", lambda: text_or_tool_call_grammar(functions, parallel, markers))


def refused_when_compiled(constraint: Constraint | None, exc: GrammarRefused) -> InvalidRequest:
    """Build the 400 of a grammar checked in prepare() that the worker's vocabulary still refuses when compiled."""
    param = constraint.param if constraint is not None else None
    return InvalidRequest(f"invalid '{param}': it cannot be enforced: {exc}", param=param)
