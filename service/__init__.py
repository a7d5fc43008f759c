"""The composition root: the one place that wires the domain, the actors and the edges.

`wiring.open_service` builds a running service over a store (actors started in one nursery,
the Quart-Trio app with its REST routes and the WebSocket event stream); `serve.serve` is the
process around it (embedded PostgreSQL, migrations, Hypercorn, signals). The tests open the
same `open_service`, so they run the wiring `registry serve` runs.
"""
