"""The HTTP routes: parse, check the cache, call the engine, respond."""

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from flask import Blueprint, Flask, Response, jsonify, request
from pydantic import BaseModel

from ..cache import current_cache, no_cache_requested, no_store_requested, settled_status
from ..engine import KvScope
from ..errors import InvalidRequest
from ..observability.observed import EngineWork, observe
from ..observability.request_record import current_record
from .auth import caller_key_hash, may_see_details
from .chat_request import parse_chat_request, parse_json_body
from .completion_request import parse_completion_request
from .corechat import current_corechat
from .disconnect import WatchedSource
from .limits import read_request_body
from .naming import resolve_model_name
from .responses import Health, Model, ModelList, Readiness
from .responses_api.request import check_retrieve_query, parse_responses_request
from .responses_api.serving import ResponsesCall
from .serving import ChatEngine, PreparedReply
from .sse import SSE_HEADERS

if TYPE_CHECKING:
    from ..engine import ChoiceGroup, EventSource, Generation

bp = Blueprint("api", __name__)

# What /readyz tells a caller without a key; and what it never tells anyone (exception text and file
# paths, which go to the log).
PUBLIC_READINESS = ("status", "worker_pid", "running", "waiting", "requests_finished")
PRIVATE_FACTS = ("error", "converted_weights")


def read_json_body():
    """Return the request's JSON body, refusing other content types."""
    if request.mimetype != "application/json":
        error = InvalidRequest("the request body must be JSON sent with 'Content-Type: application/json'")
        error.status = 415
        raise error
    return parse_json_body(read_request_body())


class GenerationServing(Protocol):
    """What the generating routes need of a serving class (chat's and legacy completions')."""

    engine: ChatEngine

    def prepare(self, request: Any) -> PreparedReply:
        """Check a parsed request against the model, or raise a 4xx."""

    def start(self, prepared: Any, forced_ids: tuple[int, ...] = (),
              kv_scope: KvScope = KvScope()) -> "Generation | ChoiceGroup":
        """Queue the reply's generation, its stored KV state kept in `kv_scope`, or raise a 503."""

    def stream(self, prepared: Any, source: "EventSource") -> Iterator[str]:
        """Render a reply's events as Server-Sent Events."""

    def complete(self, prepared: Any, source: "EventSource") -> BaseModel:
        """Read a reply's events to its end and return the whole response object."""


def serve_generation(serving: GenerationServing, parsed_request):
    """Prepare a request, look its reply up in the cache (or generate it), and send it streamed or whole."""
    cache = current_cache()
    record = current_record()
    prepared = serving.prepare(parsed_request)
    cache_control = request.headers.get("Cache-Control", "")
    bypass = cache.bypasses(prepared, serving.engine.fingerprint, opted_out=no_cache_requested(cache_control))
    scope = cache.scope(caller_key_hash(), parsed_request.cache_salt)
    kv_scope = KvScope(scope, keep=not no_store_requested(cache_control))
    try:
        reply, record.x_cache = cache.open(
            prepared,
            serving.engine.fingerprint,
            lambda forced_ids: EngineWork(serving.start(prepared, forced_ids, kv_scope)),
            scope=scope,
            bypass=bypass,
        )
    except BaseException:
        record.x_cache = cache.failed_status(bypass)
        raise
    source = observe(reply)
    if parsed_request.stream:
        response = Response(serving.stream(prepared, source), mimetype="text/event-stream", headers=SSE_HEADERS)
    else:
        try:
            completion = serving.complete(prepared, WatchedSource(source, request.environ))
            response = jsonify(completion.model_dump(exclude_unset=True))
        finally:
            record.x_cache = settled_status(reply, record.x_cache)
    # A stream whose client is gone before its first byte never runs its generator's `finally`.
    response.call_on_close(source.cancel)
    return response


@bp.post("/v1/chat/completions")
def create_chat_completion():
    """Generate a chat completion, streamed as SSE or returned whole."""
    return serve_generation(current_corechat().chat, parse_chat_request(read_json_body()))


@bp.post("/v1/completions")
def create_completion():
    """Continue a raw prompt (legacy text completions), streamed as SSE or returned whole."""
    return serve_generation(current_corechat().completions, parse_completion_request(read_json_body()))


@bp.post("/v1/responses")
def create_response():
    """Create a response (OpenAI's Responses API), streamed as typed SSE events or returned whole."""
    call = ResponsesCall(parse_responses_request(read_json_body()), owner=caller_key_hash())
    return serve_generation(current_corechat().responses, call)


@bp.get("/v1/responses/<response_id>")
def get_response(response_id: str):
    """Return a response the caller's API key stored; any other id (another key's too) is a 404."""
    check_retrieve_query(request.args)
    return jsonify(current_corechat().responses.retrieve(caller_key_hash(), response_id).model_dump())


@bp.post("/tokenize")
def tokenize():
    """Turn text, or a conversation through the chat template, into the model's token ids."""
    tokens = current_corechat().tokens
    return jsonify(tokens.tokenize(read_json_body()).model_dump())


@bp.post("/detokenize")
def detokenize():
    """Turn the model's token ids back into text."""
    tokens = current_corechat().tokens
    return jsonify(tokens.detokenize(read_json_body()).model_dump())


def _model_card(name: str) -> Model:
    """Describe the served model under one of its names as OpenAI's model object."""
    core = current_corechat()
    return Model(id=name, object="model", created=core.started_at, owned_by="corechat")


@bp.get("/v1/models")
def list_models():
    """List every name the served model answers to."""
    names = current_corechat().settings.served_model_names
    return jsonify(ModelList(object="list", data=[_model_card(name) for name in names]).model_dump())


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str):
    """Describe the served model under a name it answers to, or 404 for any other id."""
    settings = current_corechat().settings
    return jsonify(_model_card(resolve_model_name(settings, model_id)).model_dump())


@bp.get("/healthz")
def check_health():
    """Answer at once while the process is alive (liveness)."""
    return jsonify(Health(status="ok").model_dump())


@bp.get("/readyz")
def check_ready():
    """Answer 200 once this worker's model is loaded and warmed up, 503 before (readiness).

    Probes carry no key: without one (when keys are on) the body is the status and counts alone.
    """
    core = current_corechat()
    engine = core.engine
    facts = engine.snapshot_facts().known()
    body = {
        "status": "ready" if engine.ready else facts["state"],
        "model": core.chat.model_name,
        "worker_pid": os.getpid(),
        **{key: value for key, value in facts.items() if key not in ("state", *PRIVATE_FACTS)},
        "running": engine.running,
        "waiting": engine.waiting,
    }
    if not may_see_details():
        body = {key: body[key] for key in PUBLIC_READINESS if key in body}
    return jsonify(Readiness.model_validate(body).model_dump(exclude_unset=True)), 200 if engine.ready else 503


def init_app(app: Flask) -> None:
    """Register the routes."""
    app.register_blueprint(bp)
