"""Every setting of corechat, read once from the environment.

This module must stay importable without torch: `gunicorn.conf.py` reads it in the master, and the
master never touches torch.
"""

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DEMO_MODEL_DIR = Path.home() / ".cache" / "corechat" / "demo-qwen2.5-0.5b"


def _allowed_cpus() -> list[int]:
    """Return the CPUs this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def physical_core_groups() -> list[list[int]]:
    """Group the CPUs this process may use by physical core (SMT siblings share a group)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in _allowed_cpus():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            package, core = "?", str(cpu)
        groups.setdefault((package, core), []).append(cpu)
    return list(groups.values())


def physical_cores() -> int:
    """Count the physical cores this process may use (logical CPUs minus SMT siblings)."""
    return max(1, len(physical_core_groups()))


class Settings(BaseSettings):
    """The service's configuration; each field is read from the environment variable of its name."""

    model_config = SettingsConfigDict(frozen=True, case_sensitive=False, extra="ignore")

    # Model
    model: str = Field(
        str(DEFAULT_DEMO_MODEL_DIR),
        description="Local Hugging Face model folder or hub id. Defaults to the demo model that "
        "`make serve` builds (random weights).",
    )
    model_name: str = Field(
        "", description="Name served in `/v1/models` and responses; defaults to the folder name or hub id."
    )
    dtype: str = Field("bfloat16", description="Weight and compute dtype: bfloat16 or float32.")
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
    max_queue: int = Field(
        16, ge=1, description="Requests a worker accepts beyond those running; more get a 503."
    )
    max_running: int = Field(
        4, ge=1, description="Sequences a worker's engine generates at once, interleaved token by token."
    )
    warmup: bool = Field(True, description="Run a short real generation before reporting ready.")
    sse_ping_seconds: float = Field(
        5.0, gt=0, description="Interval of `: ping` comments while a stream waits for its first token."
    )

    # Web server (read by gunicorn.conf.py)
    bind: str = Field("127.0.0.1:8000", description="Address Gunicorn listens on.")
    workers: int = Field(0, ge=0, description="Gunicorn workers; 0 means one per physical core.")
    http_threads: int = Field(
        16, ge=1, description="Threads per worker for HTTP: streams, health checks and scrapes in parallel."
    )
    worker_timeout: int = Field(
        60, ge=1, description="Seconds of silence from a worker's main loop before Gunicorn restarts it; "
        "streams of any length are unaffected."
    )
    graceful_timeout: int = Field(
        120, ge=1, description="Seconds a stopping worker lets in-flight streams finish."
    )
    log_level: str = Field("info", description="Log level of the service and Gunicorn.")

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, value: str) -> str:
        """Accept only dtypes the engine knows."""
        if value not in ("bfloat16", "float32"):
            raise ValueError("dtype must be bfloat16 or float32")
        return value

    @property
    def served_model_name(self) -> str:
        """Return the model name clients see."""
        return self.model_name or Path(self.model.rstrip("/")).name or self.model

    @property
    def worker_count(self) -> int:
        """Return the number of Gunicorn workers."""
        return self.workers or physical_cores()

    @property
    def threads_per_worker(self) -> int:
        """Return torch intra-op threads for one worker."""
        return self.torch_threads or max(1, physical_cores() // self.worker_count)

    # Access control
    api_keys: SecretStr = Field(
        SecretStr(""), description="Comma-separated API keys; when any is set, every route but /healthz, "
        "/readyz and the chat page's files needs `Authorization: Bearer <key>`. Empty: no keys needed."
    )
    metrics_require_key: bool = Field(
        False, description="Ask for an API key on /metrics too; off by default because /metrics "
        "belongs on a private port or network, where Prometheus scrapes it without a key."
    )
    cors_origins: str = Field(
        "", description="Comma-separated origins (scheme://host[:port]) whose pages may call the API "
        "from a browser; none by default. `*` is not accepted: list each frontend."
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
