"""With int8 and int4 weights a reply does not depend on what else its worker decodes, over HTTP too: the
same requests alone and beyond capacity through Gunicorn with the defaults give the same replies."""

from harness import ready_facts
from service.settings import Settings


def test_replies_over_http_alone_equal_the_same_requests_beyond_capacity(gunicorn):
    """`make serve`'s defaults (int8, one worker per core, MAX_RUNNING, prefix store on): each of
    more requests than the workers can run at once gets, byte for byte, the reply it got alone."""
    import concurrent.futures

    import requests
    defaults = Settings()
    with gunicorn(workers=defaults.worker_count) as server:
        capacity = server.workers * defaults.max_running
        bodies = [{"messages": [{"role": "user", "content": f"request {i}: " + "go on " * (1 + 23 * (i % 5))}],
                   "max_tokens": 16, **({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i})}
                  for i in range(capacity + 4)]

        def reply(body: dict) -> str:
            response = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=120,
                                     headers={"Cache-Control": "no-cache", "Connection": "close"})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]

        alone = [reply(body) for body in bodies]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(reply, bodies))
        largest = max(facts.get("largest_batch", 0) for facts in ready_facts(server).values())
    assert largest == defaults.max_running, "the load did not fill a worker's batch"
    assert together == alone
