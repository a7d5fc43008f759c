"""The WebSocket edge: the event subscription `/v1/events` (design §10, docs/events.md)."""
