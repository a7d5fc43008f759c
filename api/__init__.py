"""The HTTP edge: Quart-Trio routes, authentication, idempotency and error mapping."""
