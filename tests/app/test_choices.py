"""`n` > 1 choices share one prompt pass (the engine in this process)."""

from service.engine import SamplingParams
from tests.support import started_engine

PROMPT = "Once upon a time, in a land of caches,"


class PromptTokenCounter:
    """Wrap a runner's prompt passes and count the tokens they are fed."""

    def __init__(self, runner):
        self.prefill = runner.prefill
        self.prompt_tokens = 0

    def __call__(self, kv, token_ids, keep_last):
        self.prompt_tokens += len(token_ids)
        return self.prefill(kv, token_ids, keep_last)


def test_the_choices_share_one_prompt_pass(make_settings):
    with started_engine(make_settings(max_model_len=256, prefix_cache_mb=0)) as engine:
        runner = engine._scheduler.runner
        counter = PromptTokenCounter(runner)
        runner.prefill = counter
        prompt = engine.template.encode(PROMPT)
        group = engine.submit_choices(prompt, [SamplingParams(max_tokens=4, seed=index) for index in range(3)])
        events = list(group.events())
    assert counter.prompt_tokens == len(prompt)
    assert events[-1].completion_tokens == 12 and events[-1].prompt_tokens == len(prompt)
