"""corechat's tests, in tiers by what they need (`make test` runs them all):

- unit/: functions and modules alone, no engine and no server (seconds);
- app/: the app through Flask's test client and the engine in this process, on the tiny dev model,
  with a throwaway redis-server where the cache needs one (a minute or two);
- e2e/: real processes, as operators run them: Gunicorn, nginx, a browser, the supervisor, Redis
  Sentinel, the shipped deploy files checked by the tools that read them, and the benchmarks.

conftest.py holds the fixtures the tiers share; support.py the tests' helpers; harness/ (at the
repository's root) what the tests and the benchmarks both drive corechat with.
"""
