"""Observability: the Prometheus metrics, the wrappers that time and count generations, and the
record of one HTTP request that the hooks and the view share.

It reads the engine's events and facts and the request's record, and never the views: the API and
the cache call in here, and nothing here calls back.
"""
