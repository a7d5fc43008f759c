"""The WebSocket event subscription (`/v1/events`, design §10).

Not built yet: no route is served.
"""
