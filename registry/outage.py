"""Logs an operator can read in an outage (sans-IO: time is an input).

Theory of operation: a failure that repeats (every subscriber that cannot follow the log, every
restart of an actor while the database is down) is one condition, not a thousand events. A
`ConditionLog` turns the stream of failures and successes of one thing into the few lines worth
logging: the first failure of a condition, once; the same condition again, summarised at most
every `every` seconds with the count since the last line; a different condition, at once; and
the recovery, once, with how long it lasted and how many failures it counted. The caller logs
what it is given (no traceback: these are known conditions).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ConditionLog:
    what: str  # the thing that fails, e.g. "event subscriptions"
    every: float = 60.0  # seconds between two lines about the same condition
    condition: str | None = None
    since: float = 0.0
    last_line: float = 0.0
    failures: int = 0  # in the current condition
    unlogged: int = 0  # failures since the last line

    def failed(self, condition: str, now: float) -> str | None:
        """A failure in `condition` at `now`: the line to log, if one is due."""
        if condition != self.condition:
            self.condition, self.since, self.last_line = condition, now, now
            self.failures, self.unlogged = 1, 0
            return f"{self.what}: {condition}"
        self.failures += 1
        self.unlogged += 1
        if now - self.last_line < self.every:
            return None
        line = (
            f"{self.what}: still {condition} for {now - self.since:.0f}s"
            f" ({self.unlogged} more failures since the last line)"
        )
        self.last_line, self.unlogged = now, 0
        return line

    def succeeded(self, now: float) -> str | None:
        """A success at `now`: the recovery line, if a condition was on."""
        if self.condition is None:
            return None
        line = (
            f"{self.what}: back after {now - self.since:.1f}s of {self.condition}"
            f" ({self.failures} failures)"
        )
        self.condition, self.failures, self.unlogged = None, 0, 0
        return line
