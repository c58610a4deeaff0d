"""The process layer: Gunicorn's hooks and worker class, and the supervisor that runs Gunicorn under systemd.

The rule of this package: the Gunicorn master never imports torch. gunicorn.conf.py imports the
hooks (lifecycle.py, multiproc.py) and the master resolves the worker class (worker.py) before it
forks; the supervisor (supervisor.py, with listener.py and systemd.py) and `reload.py` run beside
it. None of them imports torch at its top, nor anything that does: the engine package re-exports
lazily, so `engine.cores` is torch-free. torch comes into a worker after fork, when
lifecycle.boot_worker starts its engine, and into the master only when PRELOAD_LIBRARIES asks it to
import the workers' libraries before forking (lifecycle.import_worker_libraries), so the workers
share them. tests/unit/test_process.py loads gunicorn.conf.py, runs the master's hooks and imports every
module here with torch made unimportable. The supervisor also does without Flask.
"""
