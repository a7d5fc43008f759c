"""The registry domain core: wire models, canonical JSON, DIDs, signatures, use-cases.

Nothing in this package imports Quart, Hypercorn, `api`, `ws` or `actors`; the only I/O lives in
`registry.store` (PostgreSQL) and `registry.client` (the HTTP client for people).
"""
