"""The registry domain core: wire models, canonical JSON, DIDs, signatures, use-cases.

Nothing in this package imports Quart, Hypercorn, `api`, `ws` or `actors`; the only I/O lives in
`registry.store` (the storage port, its PostgreSQL adapter and its in-memory fake). The HTTP
client for people is `cli.client`.
"""
