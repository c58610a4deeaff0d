"""Every setting of corechat, read once from the environment.

This module must stay importable without torch: `gunicorn.conf.py` reads it in the master before
it decides whether to import torch at all (PRELOAD_LIBRARIES).
"""

import ipaddress
import os
import tempfile
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .topology import physical_cores

DEFAULT_DEMO_MODEL_DIR = Path.home() / ".cache" / "corechat" / "demo-qwen2.5-0.5b"


class Settings(BaseSettings):
    """The service's configuration; each field is read from the environment variable of its name."""

    model_config = SettingsConfigDict(frozen=True, case_sensitive=False, extra="ignore")

    # Model
    model: str = Field(
        str(DEFAULT_DEMO_MODEL_DIR),
        description="Local Hugging Face model folder, GGUF file (converted once into a float32 folder under "
        "CONVERTED_WEIGHTS_DIR) or hub id; Qwen2, Qwen3 and Llama architectures run the fast path. Defaults to "
        "the demo model that `make serve` builds (random weights); `make serve MODEL=smollm2` serves a real one.",
    )
    model_name: str = Field(
        "", description="Comma-separated aliases accepted besides the model's own id (a hub id as given, a "
        "folder's name); all are listed in `/v1/models`, and replies carry the name the request sent, else "
        "the first alias, else the model's id."
    )
    dtype: str = Field(
        "int8", description="Weight format: int8, int4 or int4m (Linear weights as 8- or 4-bit integers, a "
        "float16 scale per group of 32, int4m also a float16 minimum; the 4-bit formats' output layer int6 and value "
        "products int8, their other layers rounded by GPTQ on a built-in calibration text), converted once into a "
        "file beside the model that workers share, the rest bfloat16; or bfloat16, or "
        "float32. int8, int4 and int4m run corechat's own kernels, and their replies do not depend on what else a "
        "worker decodes (docs/performance.md); what each format costs in faithfulness: docs/configuration.md."
    )
    max_model_len: int = Field(
        0, ge=0, description="Context window in tokens; 0 takes the model's max_position_embeddings."
    )
    default_max_tokens: int = Field(
        512, ge=1, description="Completion length when a request gives no max_tokens."
    )
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_generation_seconds: float = Field(
        300.0, gt=0, description="Wall-clock cap on one generation; a reply cut by it ends with "
        "finish_reason `length`."
    )

    # Engine, one per worker
    torch_threads: int = Field(
        0, ge=0, description="Intra-op threads per worker; 0 means physical cores / workers (at least 1)."
    )
    pin_workers: bool = Field(
        False, description="Pin each worker to its own physical cores with sched_setaffinity."
    )
    lend_idle_cores: bool = Field(
        True, description="A worker with work also uses the cores of workers that have none, so a lone stream "
        "runs on every core; once all are busy each keeps its own. Off, or with PIN_WORKERS, each worker keeps "
        "its TORCH_THREADS. Assumes the machine's cores are the service's (docs/performance.md)."
    )
    gather_streams: bool = Field(
        True, description="A worker with nothing to do leaves new connections to a busy worker whose batch has "
        "room (fewer than MAX_RUNNING streams, little prompt work ahead), so streams decode as one batch on the "
        "cores the idle workers lend it, reading the weights once per token (docs/performance.md). Needs "
        "LEND_IDLE_CORES (and so not PIN_WORKERS); connections kept alive stay with their worker."
    )
    max_queue: int = Field(
        16, ge=1, description="Requests a worker accepts beyond those running; more get a 503."
    )
    max_running: int = Field(
        8, ge=1, description="Sequences a worker's engine decodes together in one batched forward per token; "
        "a higher value absorbs the uneven way the kernel hands connections to workers (docs/performance.md)."
    )
    prefill_chunk_tokens: int = Field(
        128, ge=16, description="Prompt tokens a worker processes at most between two decode steps of its "
        "running streams, so a long prompt arriving delays their next token by at most this much work; "
        "smaller chunks keep the streams smoother and make a cold prompt's own first token a little later "
        "(docs/performance.md)."
    )
    prefill_stall_seconds: float = Field(
        0.5, ge=0.0, allow_inf_nan=False, description="While a worker's streams are decoding, the prompt "
        "work it does between two of their tokens is cut to about this long, at the prompt speed it last "
        "measured (at least 16 tokens, at most PREFILL_CHUNK_TOKENS); 0 cuts by PREFILL_CHUNK_TOKENS alone."
    )
    speculative_tokens: int = Field(
        8, ge=0, le=16, description="Draft tokens a decoding stream proposes per step from its own prompt and "
        "reply (where its last tokens occurred before, the tokens that followed them), checked in the same "
        "forward as its next token; the drafts the sampler would have chosen are taken, so replies are the "
        "same bytes, only sooner on text that repeats itself or its prompt. int8, int4 and int4m only (their rows "
        "do not depend on the batch), never while requests wait or the batch is full: a step runs at most "
        "MAX_RUNNING rows. 0 turns it off (docs/performance.md)."
    )
    kv_cache_mb: int = Field(
        1024, ge=1, description="Memory per worker for the KV state of running sequences, in pages of 64 "
        "tokens. A request starts only when the pages of its prompt plus max_tokens (each choice's) are free, "
        "and holds them until it ends; the others wait in the queue, and one that could never fit gets a 400. "
        "At 12 KiB per token (Qwen2.5-0.5B) the default holds 1,365 pages, 87,360 tokens."
    )
    warmup: bool = Field(True, description="Run a short real generation before reporting ready.")
    sse_ping_seconds: float = Field(
        5.0, gt=0, description="Interval of `: ping` comments while a stream waits for its first token."
    )

    # Web server (read by gunicorn.conf.py)
    bind: str = Field("127.0.0.1:8000", description="Address Gunicorn listens on.")
    workers: int = Field(0, ge=0, description="Gunicorn workers; 0 means one per physical core.")
    spare_http_threads: int = Field(
        4, ge=1, description="Request threads per worker beyond one per chat request it admits (MAX_RUNNING + "
        "MAX_QUEUE), kept free for quick requests: probes, scrapes, model lists. A chat request beyond those "
        "places gets a 503 from the worker's event loop at once, so no request waits unseen for a thread."
    )
    request_arrival_seconds: float = Field(
        10.0, gt=0, description="Seconds a client may take to send a whole request (headers and body) from "
        "its first byte; a slower one gets a 408. Requests arrive in the worker's event loop, so a slow "
        "client holds no request thread meanwhile."
    )
    send_timeout_seconds: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="Seconds a response may wait on a client that reads none of "
        "it (its receive window stays closed) or acknowledges nothing: the kernel then aborts the connection "
        "(TCP_USER_TIMEOUT), the generation is cancelled and counted in corechat_send_timeouts_total, and its "
        "place is freed for the next request."
    )
    worker_timeout: int = Field(
        60, ge=1, description="Seconds of silence from a worker's main loop before Gunicorn restarts it; "
        "streams of any length are unaffected."
    )
    graceful_timeout: int = Field(
        120, ge=1, description="Seconds a stopping worker lets in-flight streams finish."
    )
    log_level: str = Field("info", description="Log level of the service and Gunicorn.")
    preload_libraries: bool = Field(
        True, description="Import torch, transformers and the app's modules, and load the tokenizer of a MODEL "
        "folder, in the Gunicorn master before it forks the workers (no model, no tensor, no thread pool), so "
        "the workers share that state instead of each building a private copy (see docs/performance.md). A "
        "GGUF MODEL is converted first, in a child process."
    )

    # Cache
    redis_url: SecretStr = Field(
        SecretStr(""), description="Redis shared by every worker and host for the response cache (redis://, "
        "rediss://, with password or ACL user; kept out of reprs and logs); empty keeps an in-process LRU per worker. "
        "`redis+sentinel://[user:password@]host:26379,host2:26379/<master-name>/<db>` (rediss+sentinel:// for TLS) "
        "asks those sentinels for the master and follows it through a failover (docs/cache.md)."
    )
    redis_sentinel_password: SecretStr = Field(
        SecretStr(""), description="Password of the sentinels themselves (their requirepass), when REDIS_URL is a "
        "redis+sentinel:// URL; the URL's own password is the master's. Empty: the sentinels ask for none."
    )
    cache_scope: Literal["key", "shared"] = Field(
        "key", description="With API_KEYS set, `key` gives each API key its own cached replies and "
        "single-flights, so no client can tell what another asked; `shared` lets every key hit every reply "
        "(for a frontend that holds one key for all its users; a client can then learn, by X-Cache or timing, "
        "that someone sent the same conversation). Without API_KEYS there is one shared scope."
    )
    cache_ttl_seconds: int = Field(86400, ge=1, description="How long a cached reply lives.")
    cache_max_entry_bytes: int = Field(
        1_000_000, ge=1, description="Largest encoded reply the cache stores; longer replies are not cached."
    )
    cache_local_entries: int = Field(
        1024, ge=1, description="Replies the in-process cache of one worker keeps (used without REDIS_URL)."
    )
    cache_lease_seconds: float = Field(
        3.0, gt=0, description="Expiry of the single-flight lock; the generating worker renews it three times "
        "per lease whatever its client reads, and followers take over this long after that worker died."
    )
    cache_poll_seconds: float = Field(
        0.1, gt=0, description="Longest a follower waits on Redis in one call before checking its leader."
    )
    cache_connect_timeout_seconds: float = Field(
        0.1, gt=0, description="Redis connect timeout; a dead Redis costs at most this per breaker period."
    )
    cache_socket_timeout_seconds: float = Field(
        0.25, gt=0, description="Redis read and write timeout: a hung Redis costs a request at most this "
        "before the breaker opens. A follower's wait for new chunks gets CACHE_POLL_SECONDS on top."
    )
    cache_breaker_seconds: float = Field(
        2.0, gt=0, description="After a Redis failure, serve uncached for this long before trying Redis again."
    )
    cache_error_log_seconds: float = Field(
        60.0, gt=0, description="Log Redis failures at most once per this interval."
    )
    responses_store_ttl_seconds: int = Field(
        30 * 86400, ge=1, description="How long a response kept by `store` (POST /v1/responses) stays in REDIS_URL's "
        "Redis for GET /v1/responses/{id} and previous_response_id, as OpenAI keeps them (30 days). Without "
        "REDIS_URL nothing is kept: `store` defaults to false and `store: true` is a 400 (docs/api.md)."
    )

    # Metrics
    prometheus_multiproc_dir: str = Field(
        "", description="Folder where the workers share their metric values (prometheus_client's "
        "multiprocess mode); emptied when Gunicorn starts (under service.process.supervisor, which runs two "
        "masters on it during a reload, when the supervisor starts). gunicorn.conf.py defaults it to a "
        "folder per master under the temp dir, the supervisor to one of its own; empty outside Gunicorn: "
        "/metrics serves this process alone."
    )

    # Limits
    max_request_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest request body in bytes, chunked or not; a larger one gets a 413."
    )
    max_messages: int = Field(256, ge=1, description="Most messages one chat request may carry.")
    max_prompt_tokens: int = Field(
        0, ge=0, description="Most prompt tokens one request may send; 0 means only the context window limits it."
    )
    trust_control_tokens_in_messages: bool = Field(
        False, description="Parse control-token text inside message content (`<|im_start|>`) as the control "
        "token itself, as the bare chat template does. Off by default: such text is encoded as ordinary text, "
        "so a message cannot forge a turn. Turn on only when every caller may write whole prompts."
    )

    # Performance
    prefix_cache_mb: int = Field(
        1024, ge=0, description="Memory of the host for the KV state of recent prompts and replies, shared by "
        "every worker, reused when a new prompt starts with one of them (a shared system prompt, a "
        "conversation's earlier turns and replies, whichever worker answered them); 0 turns prefix reuse off.",
    )
    prefix_cache_dir: str = Field(
        "", description="Folder, on tmpfs, where the workers keep that KV state (PREFIX_CACHE_MB for the "
        "whole folder); it must be this user's alone. Empty means /dev/shm/corechat-prefixes-<uid>; "
        "the systemd unit sets /run/corechat/prefixes.",
    )
    shared_kv_ttl_seconds: int = Field(
        0, ge=0, description="Seconds a finished conversation turn's KV state stays in Redis (REDIS_URL) for the "
        "other hosts, so the next turn landing on another host fetches it instead of recomputing its prompt; 0 "
        "keeps KV state on its host (docs/deploy.md: several hosts). Redis holds about 12 KiB per token of "
        "Qwen2.5-0.5B, and it is trusted with the KV state as with cached replies."
    )
    shared_kv_max_mb: int = Field(
        64, ge=1, description="Largest KV state (one conversation turn) sent to Redis with SHARED_KV_TTL_SECONDS; a "
        "worker holds one such entry in memory while it fetches it."
    )
    shared_kv_redis_url: SecretStr = Field(
        SecretStr(""), description="Redis for the KV state SHARED_KV_TTL_SECONDS shares, apart from REDIS_URL's "
        "replies: entries of up to SHARED_KV_MAX_MB in the replies' Redis would push cached replies, single-flight "
        "locks and streams out of its memory. The shipped deploy/redis/corechat-kv.conf is such an instance "
        "(127.0.0.1:6381). Same URL forms as REDIS_URL; empty: REDIS_URL itself (with a warning at start)."
    )
    shared_kv_socket_timeout_seconds: float = Field(
        2.0, gt=0, description="Redis read and write timeout for shared KV state: a fetch that takes longer is "
        "given up and the prompt computed."
    )
    converted_weights_dir: str = Field(
        str(Path.home() / ".cache" / "corechat" / "converted"),
        description="Where a GGUF MODEL is converted into a model folder, and where DTYPE=int8, int4 or int4m writes "
        "its converted weights and every DTYPE keeps the weight files' hashes (the model's fingerprint) when the "
        "model folder is read-only.",
    )
    kernel_path: Literal["best", "amx", "avx512_vnni", "avx2", "reference"] = Field(
        "best", description="The kernels' instruction-set path: best (the best this CPU runs), or one it runs "
        "(avx2 on an AVX-512 CPU runs what an AVX2-only CPU runs; avx512_vnni runs attention without the bfloat16 "
        "dot product a CPU may have; amx is the best AVX-512 path with a prompt's products on the tile unit). Every "
        "path gives the same bits; a worker whose CPU lacks the path fails to start."
    )
    kernels_dir: str = Field(
        str(Path.home() / ".cache" / "corechat" / "kernels"),
        description="Where a worker builds corechat's C++ kernels when the virtualenv holds no build for this "
        "CPU and cannot be written (`make setup` and deploy/install.sh build into the virtualenv).",
    )

    @field_validator("converted_weights_dir", "kernels_dir", "prefix_cache_dir")
    @classmethod
    def _expand_home(cls, value: str) -> str:
        """Expand `~`, as the example environment file writes the default."""
        return os.path.expanduser(value)

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        """Accept only dtypes the engine knows."""
        if value not in ("bfloat16", "float32", "int8", "int4", "int4m"):
            raise ValueError("dtype must be int8, int4, int4m, bfloat16 or float32")
        return value

    @property
    def model_id(self) -> str:
        """Return the model's own id: a hub id whole, as vLLM serves it, or a local folder's name."""
        folder = Path(self.model).expanduser()
        if folder.is_dir() or folder.is_absolute() or self.model.startswith((".", "~")):
            return folder.name or self.model
        return self.model

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Return every name a request may send for the model: the aliases of MODEL_NAME, then its id."""
        return tuple(dict.fromkeys([*_split_list(self.model_name), self.model_id]))

    @property
    def served_model_name(self) -> str:
        """Return the name replies carry when the request named none: the first alias, else the model's id."""
        return self.served_model_names[0]

    # Counted once, when the settings are read (in Gunicorn's master): a pinned worker sees only its
    # own cores afterwards, and would count itself as the only worker.
    @cached_property
    def worker_count(self) -> int:
        """Return the number of Gunicorn workers."""
        return self.workers or physical_cores()

    @cached_property
    def threads_per_worker(self) -> int:
        """Return torch intra-op threads for one worker."""
        return self.torch_threads or max(1, physical_cores() // self.worker_count)

    @property
    def prefix_store_root(self) -> Path:
        """Return the folder of the host's stored prefixes."""
        if self.prefix_cache_dir:
            return Path(self.prefix_cache_dir)
        shared = Path("/dev/shm")
        return (shared if shared.is_dir() else Path(tempfile.gettempdir())) / f"corechat-prefixes-{os.getuid()}"

    @property
    def request_places(self) -> int:
        """Return how many chat requests one worker serves at once: running, or queued for its engine."""
        return self.max_running + self.max_queue

    @property
    def http_threads(self) -> int:
        """Return the request threads of one worker: one per chat request place, and the spare ones."""
        return self.request_places + self.spare_http_threads

    def model_post_init(self, _context) -> None:
        """Count the workers and their threads now, before any worker pins itself to its cores."""
        _ = self.worker_count, self.threads_per_worker

    # Access control
    api_keys: SecretStr = Field(
        SecretStr(""), description="Comma-separated API keys; when any is set, every route but /healthz, "
        "/readyz and the chat page's files needs `Authorization: Bearer <key>`. Empty: no keys needed."
    )
    metrics_require_key: bool = Field(
        True, description="With API_KEYS set, /metrics needs a key too, as every other route but the probes and "
        "the chat page (Prometheus sends one with `authorization.credentials_file`, see "
        "deploy/prometheus/prometheus.yml). false opens /metrics to anyone who reaches Gunicorn."
    )
    cors_origins: str = Field(
        "", description="Comma-separated origins (scheme://host[:port]) whose pages may call the API "
        "from a browser; none by default. `*` is not accepted: list each frontend."
    )
    allowed_networks: str = Field(
        "", description="Comma-separated addresses or networks (CIDR) besides loopback that may connect to "
        "Gunicorn: with a BIND on other interfaces, the nginx hosts and Prometheus. A worker closes any other "
        "connection at once, and deploy/install.sh writes the same list into the unit's IPAddressAllow= "
        "(list a Redis on another host too: the unit lets corechat reach only these). Empty: loopback only."
    )

    @field_validator("cors_origins")
    @classmethod
    def _check_cors_origins(cls, value: str) -> str:
        """Accept only exact origins, so a typo fails at start instead of silently refusing a frontend."""
        for origin in _split_list(value):
            scheme, _, host = origin.partition("://")
            if scheme not in ("http", "https") or not host or "/" in host:
                raise ValueError(f"cors_origins: {origin!r} is not an origin like https://chat.example.com")
        return value

    @field_validator("allowed_networks")
    @classmethod
    def _check_allowed_networks(cls, value: str) -> str:
        """Accept only addresses and networks, so a typo fails at start instead of shutting a host out."""
        for network in _split_list(value):
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(
                    f"allowed_networks: {network!r} is not an address or network like 10.0.0.0/24"
                ) from None
        return value

    @property
    def allowed_network_list(self) -> tuple:
        """Return the networks besides loopback that may connect to Gunicorn."""
        return tuple(ipaddress.ip_network(network, strict=False) for network in _split_list(self.allowed_networks))

    @property
    def api_key_list(self) -> tuple[str, ...]:
        """Return the configured API keys; empty when the API is open."""
        return tuple(_split_list(self.api_keys.get_secret_value()))

    @property
    def cors_origin_set(self) -> frozenset[str]:
        """Return the origins allowed to call the API from a browser."""
        return frozenset(_split_list(self.cors_origins))


def _split_list(value: str) -> list[str]:
    """Split a comma-separated setting into its non-empty, stripped items."""
    return [item.strip() for item in value.split(",") if item.strip()]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Read the settings from the environment once per process."""
    return Settings()
