"""What an engine reports about itself: its state and the facts it measured while loading and serving."""

import dataclasses
import enum
import threading
from dataclasses import dataclass, field


class EngineState(enum.Enum):
    """Where the engine is in its life; `ready` is also told by Engine.ready."""

    CREATED = "created"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class EngineFacts:
    """The engine's state and measurements; a field left None is not known yet and not shown on /readyz."""

    state: EngineState = EngineState.CREATED
    requests_finished: int = 0
    error: str | None = None
    tokenizer_inherited: bool | None = None
    kv_bytes_per_token: int | None = None
    kv_token_budget: int | None = None
    kernel_paths: str | None = None
    quantization: str | None = None
    converted_weights: str | None = None
    forward: str | None = None
    load_seconds: float | None = None
    dtype: str | None = None
    parameters: int | None = None
    torch_threads: int | None = None
    context_length: int | None = None
    fingerprint: str | None = None
    warmup_seconds: float | None = None
    prefix_cache_bytes: int | None = None
    prefix_cache_hits: int | None = None
    shared_prefix_hits: int | None = None
    largest_batch: int | None = None
    decode_overhead_fraction: float | None = None
    # Draft tokens of speculative steps taken into replies and not taken, since the engine started.
    accepted_draft_tokens: int | None = None
    rejected_draft_tokens: int | None = None
    slot: int | None = None
    workers: int | None = None
    lends_cores: bool | None = None
    # Held by update() and snapshot(), so a reader never sees half of one update.
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def update(self, **changes) -> None:
        """Set several facts at once, as one change a snapshot sees whole or not at all."""
        unknown = changes.keys() - {item.name for item in dataclasses.fields(self) if item.init}
        if unknown:
            raise AttributeError(f"EngineFacts has no fact {', '.join(sorted(unknown))}")
        with self._lock:
            for name, value in changes.items():
                setattr(self, name, value)

    def snapshot(self) -> "EngineFacts":
        """Return a consistent copy, safe to read while the engine thread goes on writing."""
        with self._lock:
            return dataclasses.replace(self)

    def known(self) -> dict[str, object]:
        """Return the facts that are known, by name, the state as its value (the /readyz rendering)."""
        known = {item.name: getattr(self, item.name) for item in dataclasses.fields(self)
                 if item.init and getattr(self, item.name) is not None}
        known["state"] = self.state.value
        return known
