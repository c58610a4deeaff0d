"""The fixtures the tiers share: the tiny dev model and settings on it, a started engine and Flask apps built
by the real factory (app/), corechat under real Gunicorn and a throwaway redis-server (app/, e2e/).

An engine with settings of its own is `with started_engine(make_settings(...)) as engine:`
(tests.support), a server with settings of its own `with gunicorn(workers=1, ...) as server:`.
"""

import tempfile
from pathlib import Path

import pytest

from harness import TINY_MODEL_DIR, GunicornServer, RedisServer
from service.app import create_app
from service.settings import Settings
from tests.support import TEST_API_KEY, openai_client, started_engine


def pytest_configure(config):
    """Build the tiny model and convert the real one once, in the process that starts the test workers,
    which would race to do it."""
    if not hasattr(config, "workerinput"):
        from devtools.devmodel import build_dev_model

        build_dev_model(TINY_MODEL_DIR, preset="tiny")
        smollm2_folder()


def smollm2_folder() -> Path:
    """Return the Hugging Face folder of the real SmolLM2 GGUF file, converted (once) where a worker would."""
    from devtools.smollm2 import gguf_path
    from service.engine.gguf import converted_folder

    return converted_folder(gguf_path(), Path(Settings().converted_weights_dir))


# The longest test files, started first so the two test processes end together (`make test`).
LONGEST_FIRST = {f"e2e/{name}" for name in ("test_bench.py", "test_soak.py", "test_cache_gunicorn.py",
                                            "test_gunicorn.py", "test_preload.py", "test_engine_faults.py",
                                            "test_nginx.py")}
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    """Move the longest test files to the front, keeping every file's own order."""
    items.sort(key=lambda item: item.path.relative_to(TESTS).as_posix() not in LONGEST_FIRST)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Return the folder of the tiny random-weight Qwen2 model, building it if needed."""
    from devtools.devmodel import build_dev_model

    return build_dev_model(TINY_MODEL_DIR, preset="tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Return the Hugging Face folder MODEL=<SmolLM2's GGUF file> serves (float32 weights)."""
    return smollm2_folder()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Return the real SmolLM2-135M-Instruct's GGUF file (devtools/smollm2.py), already converted for MODEL."""
    from devtools.smollm2 import gguf_path

    smollm2_folder()
    return gguf_path()


@pytest.fixture(scope="session")
def make_settings(tiny_model_dir):
    """Return a factory of Settings on the tiny model, with overrides."""

    def make(**overrides) -> Settings:
        # Each engine gets its own prefix store folder unless a test shares one on purpose.
        values = {"model": str(tiny_model_dir), "model_name": "tiny", "warmup": False, "sse_ping_seconds": 0.2,
                  "prefix_cache_dir": tempfile.mkdtemp(prefix="corechat-prefixes-")}
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture(scope="session")
def engine(make_settings):
    """Return one started engine on the tiny model, shared by the tests that only read from it."""
    with started_engine(make_settings(max_model_len=256)) as engine:
        yield engine


@pytest.fixture()
def app(make_settings, engine):
    """Return a fresh app around the shared engine."""
    return create_app(make_settings(max_model_len=256), engine=engine)


@pytest.fixture()
def client(app):
    """Return a test client of the app."""
    return app.test_client()


@pytest.fixture(scope="session")
def gunicorn(tiny_model_dir, tmp_path_factory):
    """Return a maker of corechat under real Gunicorn on the tiny model, each server logging to a folder of
    its own: `with gunicorn(workers=1, max_running=3) as server:` starts one and stops it (settings as
    harness.GunicornServer takes them, as environment variables)."""

    def make(**settings) -> GunicornServer:
        return GunicornServer(tmp_path_factory.mktemp("gunicorn"), **settings)

    return make


@pytest.fixture(scope="session")
def gunicorn_server(gunicorn):
    """Run corechat under real Gunicorn with 2 workers on the tiny model, shared by the test session."""
    with gunicorn(workers=2, max_model_len=4096, worker_timeout=3, sse_ping_seconds=0.5) as server:
        yield server


@pytest.fixture(scope="session")
def default_server(gunicorn):
    """Run Gunicorn as `make serve` does (2 workers, every setting at its default) on the tiny model."""
    with gunicorn(workers=2) as server:
        yield server


@pytest.fixture(scope="session")
def solo_server(gunicorn):
    """Run Gunicorn with one worker (every other setting at its default) on the tiny model, so concurrent
    requests share its batches; shared by the test session."""
    with gunicorn(workers=1) as server:
        yield server


@pytest.fixture(scope="session")
def solo_client(solo_server):
    """Return an openai client of solo_server that never retries."""
    return openai_client(solo_server)


@pytest.fixture(scope="session")
def keyed_server(gunicorn):
    """Run Gunicorn with 1 worker that needs TEST_API_KEY and takes one running and one waiting request.

    A third concurrent request gets a 503, and max_tokens may go up to 32000 for endless replies.
    """
    with gunicorn(workers=1, api_keys=TEST_API_KEY, max_running=1, max_queue=1, max_tokens_limit=32000,
                  sse_ping_seconds=0.5) as server:
        yield server


@pytest.fixture()
def redis_server(tmp_path):
    """Run a real redis-server on a free port for one test."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory):
    """Return a maker of real redis-servers that live until the module's tests are done:
    `module_redis()`, or `module_redis(password=...)`."""
    started = []

    def start(**options) -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis"), **options).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
