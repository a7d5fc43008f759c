"""The service's use-cases, one module per feature, each over the store port.

They sequence the pure decisions of `registry/` around the store and know nothing of HTTP:
callers pass parsed JSON and a principal, and get domain values, `Outcome`s or
`registry.errors` back. Every change goes through `registry.changes.ChangeLog`.
"""
