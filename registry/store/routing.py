"""Which database answers a read: the primary, or a streaming replica (`database.read_url`).

Theory of operation. A replica replays the primary's WAL in commit order, so at any moment it
holds a prefix of the log: every change up to some sequence (its *replayed head*, read from its
`log_head` row) and none after. A process may serve a read from the replica only when that
prefix covers everything the read must reflect:

* everything this process has written or seen (`seen`: the highest sequence among its own
  append outcomes and the log records it has read). Its caches were filled and dropped by that
  much of the log (`registry/coherence.py`); a read from an older prefix could put a value back
  into a cache that the log has already passed, where nothing would drop it again. And its own
  clients read their writes;
* the request's floor (`Registry-Min-Sequence`: a client that wrote through another process
  names the sequence it got);
* and only reads a caller allowed to lag: a GET's reads (`READ_FLOOR` set by the API) and the
  log itself (events). A write's decision always reads the primary: a lagging head would refuse
  an update with a spurious `sequence_conflict`. Rows written outside the append path (sessions,
  challenges, nonces, checkpoints, witness state) have no sequence to wait for, so they are
  always read from the primary.

Otherwise the read goes to the primary, which has every committed change, and so does the rest
of the request (a newer state, then an older one would not fit together). A replica that fails
(connection lost, no answer within `REPLICA_DEADLINE_SECONDS`, statement cancelled by a recovery
conflict) is skipped for the call and the rest of the request, and one that cannot be reached
or does not answer is left alone for `RETRY_SECONDS`; reads then fall back to the primary.
`seen` starts at the primary's log head when the process starts (where its log actor starts).
Beside the replica's head, the primary's is read every `PRIMARY_HEAD_SECONDS`: a process that
only reads has no other news of the log, and without it neither its lag nor a replica that
stopped replaying would show. A replica whose head has not moved for `STALL_SECONDS` while the
primary is ahead is treated as one that cannot be reached.
"""

from __future__ import annotations

from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field

# The least sequence the current task's reads must reflect; None: this task's reads must come
# from the primary (the default: actors and writes). Set per request by the API (GET, HEAD).
READ_FLOOR: ContextVar[int | None] = ContextVar("registry_read_floor", default=None)
# Set once the primary has answered one of the current request's reads in the replica's place:
# the rest of the request reads the primary (one request, one state), its floor kept for the
# caches (registry/caches.py). Reset per request by the API, with `READ_FLOOR`.
ON_PRIMARY: ContextVar[bool] = ContextVar("registry_on_primary", default=False)

MIN_SEQUENCE_HEADER = "Registry-Min-Sequence"
RETRY_SECONDS = 5.0  # how long an unreachable replica is left alone before it is tried again
# A replica read (a key lookup) slower than this is answered by the primary, and the replica is
# left alone a while: a replica that hangs must not hold GETs for the statement timeout (30 s).
REPLICA_DEADLINE_SECONDS = 2.0
MAX_FLOOR = 2**63 - 1
# How often the primary's log head is read beside the replica's (one key lookup): what a process
# that only reads knows of the log, so its lag shows and a replica that stopped is noticed.
PRIMARY_HEAD_SECONDS = 1.0
# A replica whose replayed head has not moved for this long while the primary is ahead has
# stopped replaying (replication broken, replay paused): it is treated as down, not read from.
STALL_SECONDS = 10.0


@dataclass
class ReplicaState:
    """What the process knows of its replica; touched only from the one Trio thread."""

    replayed: int = -1  # the replica's replayed log head when last read (-1: not yet known)
    seen: int = 0  # the highest sequence this process wrote or read from the log
    primary: int = 0  # the primary's log head when last read (every PRIMARY_HEAD_SECONDS)
    primary_read_at: float = float("-inf")  # trio.current_time() of that read
    last_replayed: int = -1  # the replica's head when last read, kept while it is down
    moved_at: float = 0.0  # when that head last moved, or last was the primary's
    down_until: float = 0.0  # trio.current_time() before which the replica is not tried
    reads: Counter[str] = field(default_factory=Counter)  # reads answered, by "replica"/"primary"
    failures: int = 0  # replica reads that failed and were answered by the primary

    def saw(self, sequence: int) -> None:
        if sequence > self.seen:
            self.seen = sequence

    def serves(self, floor: int | None, now: float) -> bool:
        """Whether a read with `floor` (None: must not lag) may go to the replica now."""
        return (
            floor is not None
            and now >= self.down_until
            and self.replayed >= 0
            and self.replayed >= max(self.seen, floor)
        )

    def replayed_to(self, replayed: int, now: float) -> bool:
        """The replica's replayed head read at `now`; False when it has stopped replaying: it
        has not moved for STALL_SECONDS while the primary (or this process) is ahead of it."""
        ahead = max(self.seen, self.primary)
        if replayed != self.last_replayed or replayed >= ahead:
            self.moved_at = now
        self.last_replayed = self.replayed = replayed
        return replayed >= ahead or now - self.moved_at < STALL_SECONDS

    @property
    def lag(self) -> int:
        """Records of the log (as this process saw it, and as the primary held it when last
        asked) that the replica had not replayed when last asked."""
        ahead = max(self.seen, self.primary)
        return max(0, ahead - self.replayed) if self.replayed >= 0 else ahead


def parse_floor(value: str) -> int:
    """A `Registry-Min-Sequence` header's value: a decimal sequence, 0..2^63-1."""
    if not value.isascii() or not value.isdigit() or len(value) > 19 or int(value) > MAX_FLOOR:
        raise ValueError("Registry-Min-Sequence must be a sequence: a decimal integer >= 0")
    return int(value)
