"""End-to-end tests: corechat under real Gunicorn, behind nginx, in a browser, under the supervisor, with Redis
and Sentinel, its deploy files checked by their tools, and the benchmarks run as scripts."""
