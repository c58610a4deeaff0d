"""A WSGI entry point for engine fault tests: the real app, in workers whose engine fails on cue.

The engine has no fault hooks of its own (production code carries no test switches), so this
module, which Gunicorn imports in each worker after fork (`gunicorn ... tests.e2e.fault_injection:app`),
patches two engine methods there to raise where a real bug would: a sequence's bookkeeping of the
token it took (what a tokenizer's DecodeStream raising in the same step looks like to the engine) and
the engine loop itself. The
cue is a request's seed, a value nothing else sends.
"""

from service.app import create_app
from service.engine.sampling import Sampler
from service.engine.scheduler import Scheduler

# A request with this seed fails while taking its third token (in a decode step, not the prompt
# pass): one sequence fails, the others go on.
SEQUENCE_FAULT_SEED = 660_001
FAULTY_TOKEN = 3
# While a request with this seed is queued, the engine loop raises: the whole worker fails.
LOOP_FAULT_SEED = 660_002

_record = Sampler.record
_drop_cancelled_waiting = Scheduler._drop_cancelled_waiting


def record_failing_on_cue(self, token_id):
    """Raise for the cued request, as a fault in one sequence's bookkeeping or text assembly would."""
    if self.params.seed == SEQUENCE_FAULT_SEED and self.position + 1 == FAULTY_TOKEN:
        raise RuntimeError("injected fault in one sequence")
    _record(self, token_id)


def loop_failing_on_cue(self):
    """Raise from the engine loop once the cued request is queued, as a bug in the loop would."""
    with self.pending.mutex:
        cued = any(generation.params.seed == LOOP_FAULT_SEED for generation in self.pending.queue)
    if cued:
        raise RuntimeError("injected fault in the engine loop")
    _drop_cancelled_waiting(self)


Sampler.record = record_failing_on_cue
Scheduler._drop_cancelled_waiting = loop_failing_on_cue

app = create_app()
