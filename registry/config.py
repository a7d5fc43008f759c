"""Configuration (design §11): a TOML file, overridden by `REGISTRY_<SECTION>__<KEY>` environment
variables (lists as JSON), overridden by command-line flags. Validated once, at start, with
messages that name the key and the source.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from registry.did import is_did, public_key_from_did_key


class ConfigError(Exception):
    """The configuration is unreadable or invalid; the message says which key and why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _did_key(value: str) -> str:
    try:
        public_key_from_did_key(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an Ed25519 did:key") from None
    return value


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    public_origin: str = "http://127.0.0.1:8080"
    data_dir: Path = Path(".registry")
    key_file: str = ""
    # How many X-Forwarded-For hops to trust for client addresses (a negative count read the
    # client's own choice of address, and failed every request without the header).
    trusted_proxies: Annotated[int, Field(ge=0, le=64)] = 0
    graceful_timeout_seconds: Annotated[float, Field(ge=0, le=600)] = 10.0
    # Connections (docs/limits.md): caps and timeouts that hold whatever a client sends.
    max_connections: Annotated[int, Field(ge=1)] = 4096  # lowered to the file limit at start
    max_connections_per_client: Annotated[int, Field(ge=1)] = 128  # per address (IPv6: /64)
    connections_per_minute_per_client: Annotated[int, Field(ge=1)] = 600  # new ones, per address
    request_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 30.0  # head and body
    read_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0  # gap within a request
    send_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 30.0  # client takes nothing
    keep_alive_timeout_seconds: Annotated[float, Field(gt=0, le=3600)] = 75.0  # between requests
    # Wrap each connection (ws/transport.py): the limits above and the events' fast path. Off
    # (or a Hypercorn the hook does not fit): Hypercorn's ordinary path, said at start.
    connection_hook: bool = True
    # Give the C heap's free pages back to the system this often (glibc; 0: never).
    memory_trim_seconds: Annotated[float, Field(ge=0, le=3600)] = 30.0

    @property
    def key_path(self) -> Path:
        return Path(self.key_file) if self.key_file else self.data_dir / "registry.key"


class DatabaseConfig(_Section):
    url: str = ""
    pool_min: Annotated[int, Field(ge=1, le=100)] = 2
    pool_max: Annotated[int, Field(ge=1, le=200)] = 16
    # A streaming replica of `url` for reads (docs/replicas.md). GET requests and the event
    # stream read it while it has replayed what this process wrote or saw; everything else,
    # and every read the replica cannot answer, goes to `url`. Empty: every read on `url`.
    read_url: str = ""
    # With a replica, the log is followed by polling it this often (a replica refuses LISTEN).
    read_poll_seconds: Annotated[float, Field(ge=0.005, le=10)] = 0.05

    @field_validator("url", "read_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if value and not value.startswith(("postgres://", "postgresql://")):
            raise ValueError("must be a postgresql:// URL, or empty for the embedded default")
        return value

    @model_validator(mode="after")
    def _replica_of_a_primary(self) -> DatabaseConfig:
        if self.read_url and not self.url:
            raise ValueError("read_url needs url: a replica of the embedded default is not served")
        return self


class AuthConfig(_Section):
    admin_dids: list[str] = Field(default_factory=list)
    federation_dids: list[str] = Field(default_factory=list)
    session_ttl_seconds: Annotated[int, Field(ge=60, le=30 * 86400)] = 43200
    chain_id: str = "registry:local"
    root_did: str = ""  # empty: the registry's own DID
    identity_resolver_url: str = ""
    default_capabilities: list[str] = Field(
        default_factory=lambda: ["entries.write", "report", "attest", "discover.federated"]
    )

    @field_validator("admin_dids", "federation_dids")
    @classmethod
    def _dids(cls, values: list[str]) -> list[str]:
        return [_did_key(v) for v in values]

    @field_validator("root_did")
    @classmethod
    def _root(cls, value: str) -> str:
        if value and not is_did(value):
            raise ValueError(f"{value!r} is not a DID")
        return value

    @field_validator("identity_resolver_url")
    @classmethod
    def _resolver(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http(s) URL, or empty for the built-in did:key identity")
        return value


DEFAULT_PAGE_SIZE = 20
# A page's byte budget goes to PostgreSQL as a parameter: bounded so that any accepted value
# fits it (a larger one was refused there, on every list, as the request's fault).
MAX_PAGE_BYTES = 1 << 30


# What an accept's body adds to the entry it carries: `{"entry":` and `}` (10 bytes), and
# `"sequence":<up to 19 digits>,` (31) where the entry was created without one.
ACCEPT_ENVELOPE_BYTES = 64


class LimitsConfig(_Section):
    read_per_minute: Annotated[int, Field(ge=1)] = 1200
    write_per_minute: Annotated[int, Field(ge=1)] = 120
    # All writes from one client address, whoever signed them (keys are free to make).
    write_per_minute_per_address: Annotated[int, Field(ge=1)] = 240
    query_per_minute: Annotated[int, Field(ge=1)] = 300
    # All queries from one client address, whoever signed them (a federated query fans out).
    query_per_minute_per_address: Annotated[int, Field(ge=1)] = 600
    # The database time (milliseconds) one client address's queries may take a minute, paid
    # after each query ran: a costly query leaves its address refused until the budget refills.
    query_db_ms_per_minute_per_address: Annotated[int, Field(ge=1)] = 15_000
    # Queries of one client address running at once in one process (the database time of those
    # in flight is not known until they end).
    query_concurrency_per_address: Annotated[int, Field(ge=1, le=1000)] = 4
    max_page_size: Annotated[int, Field(ge=1, le=1000)] = 100
    default_page_size: Annotated[int, Field(ge=1, le=1000)] = DEFAULT_PAGE_SIZE
    entry_body_bytes: Annotated[int, Field(ge=1024)] = 1024 * 1024
    query_body_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024
    federation_body_bytes: Annotated[int, Field(ge=1024)] = 4 * 1024 * 1024
    small_body_bytes: Annotated[int, Field(ge=1024)] = 64 * 1024
    # The bytes of request bodies one client address may send a minute, whoever signed them (a
    # body larger than this passes on a full budget and takes it all).
    body_bytes_per_minute_per_address: Annotated[int, Field(ge=1024)] = 16 * 1024 * 1024
    # A discovery page ends early (hasMore, with a cursor) once its documents hold this many
    # bytes: a page of 100 entries of up to 1 MiB each would otherwise be 100 MiB.
    discover_page_bytes: Annotated[int, Field(ge=1024, le=MAX_PAGE_BYTES)] = 4 * 1024 * 1024
    # A page of an entry's versions ends early likewise (100 versions of 1 MiB: 100 MiB), and a
    # page of log records once the entry versions it hashes hold this many bytes.
    versions_page_bytes: Annotated[int, Field(ge=1024, le=MAX_PAGE_BYTES)] = 4 * 1024 * 1024
    # A page of attestations or reports ends early likewise: a credential may hold up to
    # `small_body_bytes` (64 KiB), and 100 of them made a 6.4 MiB page.
    trust_page_bytes: Annotated[int, Field(ge=1024, le=MAX_PAGE_BYTES)] = 1024 * 1024
    discover_cache_entries: Annotated[int, Field(ge=0, le=100_000)] = 2000  # 0: no result cache
    cache_mib: Annotated[int, Field(ge=1, le=65536)] = 4  # each of the entry and page caches
    # Divide every per-minute limit by the processes serving from the database (counted every
    # share_refresh_seconds), so the deployment admits the configured rate; off: per process.
    shared: bool = True
    share_refresh_seconds: Annotated[float, Field(gt=0, le=3600)] = 10.0

    @property
    def accept_body_bytes(self) -> int:
        """The admission limit of an accept's body: `{"entry": …}` around an entry as large as
        an entry body, with the `sequence` its create did not need to carry."""
        return self.entry_body_bytes + ACCEPT_ENVELOPE_BYTES

    @model_validator(mode="before")
    @classmethod
    def _default_page_within_max(cls, data: Any) -> Any:
        """A `max_page_size` below the default page size lowers the default to it; only a
        `default_page_size` set explicitly above the maximum is an error (`_pages`)."""
        if not isinstance(data, dict) or "default_page_size" in data:
            return data
        try:
            maximum = int(data.get("max_page_size", DEFAULT_PAGE_SIZE))
        except (TypeError, ValueError):
            return data  # the field's own validation reports it
        if 1 <= maximum < DEFAULT_PAGE_SIZE:
            return {**data, "default_page_size": maximum}
        return data

    @model_validator(mode="after")
    def _pages(self) -> LimitsConfig:
        if self.default_page_size > self.max_page_size:
            raise ValueError("default_page_size must not exceed max_page_size")
        return self


class AnchoringConfig(_Section):
    enabled: bool = True
    batch_size: Annotated[int, Field(ge=1, le=100_000)] = 256
    block_interval_seconds: Annotated[float, Field(ge=0)] = 2.0  # 0: a block per chain call
    finality_depth: Annotated[int, Field(ge=0)] = 3
    max_attempts: Annotated[int, Field(ge=1)] = 5
    # Batches waiting for finality at once (each block can carry a new one).
    batches_in_flight: Annotated[int, Field(ge=1, le=64)] = 8


class TransparencyConfig(_Section):
    """The verifiable log (docs/transparency.md)."""

    enabled: bool = True
    # How often the checkpointer looks at the log head and issues a checkpoint if it grew.
    checkpoint_seconds: Annotated[float, Field(gt=0, le=60)] = 1.0
    # The checkpoint's origin line and the key name of its signature; empty: the registry DID.
    origin: Annotated[str, Field(max_length=200, pattern=r"^[^\s+]*$")] = ""


class PeerConfig(_Section):
    peer_did: str
    endpoint: str
    agreement_ids: list[str] = Field(default_factory=lambda: ["default"])
    kinds: list[Literal["sync", "discover"]] = Field(
        default_factory=lambda: ["sync", "discover"]  # type: ignore[arg-type]
    )

    @field_validator("peer_did")
    @classmethod
    def _peer(cls, value: str) -> str:
        return _did_key(value)


class BondsConfig(_Section):
    """How a slashed amount is split (decimal strings; they must add up to exactly 1)."""

    harmed_share: str = "0.5"
    reporter_share: str = "0.3"
    treasury_share: str = "0.2"

    @model_validator(mode="after")
    def _shares(self) -> BondsConfig:
        try:
            parts = [
                Decimal(s) for s in (self.harmed_share, self.reporter_share, self.treasury_share)
            ]
        except InvalidOperation:
            raise ValueError('bond shares must be decimal strings such as "0.5"') from None
        if any(not p.is_finite() or p < 0 for p in parts) or sum(parts, Decimal(0)) != 1:
            raise ValueError("bond shares must be non-negative and add up to exactly 1")
        return self


class FederationConfig(_Section):
    peers: list[PeerConfig] = Field(default_factory=list)
    poll_seconds: Annotated[float, Field(gt=0)] = 5.0  # between pulls of a caught-up peer
    request_timeout_seconds: Annotated[float, Field(gt=0)] = 10.0  # one sync request
    page_size: Annotated[int, Field(ge=1, le=1000)] = 1000  # maxEntries asked of a peer
    discover_budget_seconds: Annotated[float, Field(gt=0)] = 3.0  # a federated query in all
    # Endpoints a peer registers (PUT /v1/federation/peers/self): registry/endpoints.py.
    allow_http_endpoints: bool = False
    allowed_endpoint_hosts: list[str] = Field(default_factory=list)  # names, addresses, CIDRs

    @model_validator(mode="after")
    def _distinct(self) -> FederationConfig:
        dids = [p.peer_did for p in self.peers]
        if len(set(dids)) != len(dids):
            raise ValueError("each peer_did may appear only once in [[federation.peers]]")
        return self


class EventsConfig(_Section):
    """The WebSocket event stream (docs/events.md)."""

    queue_size: Annotated[int, Field(ge=1, le=1_000_000)] = 1024  # records a subscriber may lag
    heartbeat_seconds: Annotated[float, Field(gt=0)] = 20.0  # a heartbeat after this much quiet
    idle_seconds: Annotated[float, Field(gt=0)] = 60.0  # close a socket with no subscription
    send_timeout_seconds: Annotated[float, Field(gt=0)] = 30.0  # a client that takes no data
    max_connections: Annotated[int, Field(ge=1)] = 10_000
    max_connections_per_client: Annotated[int, Field(ge=1)] = 32  # sockets per client address
    # Subscriptions that start behind the log head (a replay reads the store), per client
    # address: a token bucket of this many a minute, the same number as its burst.
    replays_per_minute: Annotated[int, Field(ge=1)] = 30
    replay_concurrency: Annotated[int, Field(ge=1, le=1000)] = 4  # pages read at once, per process
    max_message_bytes: Annotated[int, Field(ge=256)] = 16 * 1024  # a client message
    messages_per_minute: Annotated[int, Field(ge=1)] = 120  # client messages per socket
    poll_seconds: Annotated[float, Field(gt=0)] = 5.0  # read the log anyway after this silence
    # At least this long between two reads of the log: each read's fan-out then carries the
    # commits of the interval together (a latency floor of this much, for far less CPU).
    coalesce_seconds: Annotated[float, Field(ge=0, le=1)] = 0.02


class LoggingConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["json", "text"] = "text"
    access: bool = True  # one line per HTTP request on the logger registry.access


class MetricsConfig(_Section):
    # Who may read GET /metrics: an admin session (false), or anyone who reaches it (true: put
    # it behind a firewall or a proxy that keeps it private).
    open: bool = False
    # "host:port" (a fixed port): also listen there, where /metrics is open and nothing else is
    # served; on server.host:port it then needs an admin session as above. Empty: no listener.
    listen: str = ""

    @property
    def address(self) -> tuple[str, int] | None:
        """`listen` as (host, port), an IPv6 literal without its brackets; None: no listener."""
        if not self.listen:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.removeprefix("[").removesuffix("]"), int(port)

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("must be host:port with a fixed port, e.g. 127.0.0.1:9464")
            # An address, not a name: a request is told to have come through the listener by
            # the address it reached (a name such as localhost was never equal to it, and the
            # whole API was served there).
            try:
                ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
            except ValueError:
                if host not in ("*",):
                    raise ValueError(
                        "the host must be an IP address (127.0.0.1, ::1, 0.0.0.0), not a name"
                    ) from None
        return value


class Config(_Section):
    server: ServerConfig = Field(default_factory=ServerConfig)
    database: DatabaseConfig = Field(default_factory=DatabaseConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    anchoring: AnchoringConfig = Field(default_factory=AnchoringConfig)
    transparency: TransparencyConfig = Field(default_factory=TransparencyConfig)
    bonds: BondsConfig = Field(default_factory=BondsConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @property
    def held_connections(self) -> list[str]:
        """What holds a pooled connection for the process's lifetime (`take(lasting=True)`):
        the log actor's LISTEN and the leaderships' advisory locks, each held (or polled for)
        by every process, leader or not."""
        held = [] if self.database.read_url else ["the log's LISTEN"]
        if self.transparency.enabled:
            held.append("the transparency leadership")
        if self.anchoring.enabled:
            held.append("the anchoring leadership")
        if any("sync" in p.kinds for p in self.federation.peers):
            held.append("the federation leadership")
        return held

    @model_validator(mode="after")
    def _metrics_listener_apart(self) -> Config:
        # Both are bound by one Hypercorn: the second bind failed after the start (migrations
        # done) with "already in use; stop what listens there", though nothing else did.
        address = self.metrics.address
        if address is not None and address[1] == self.server.port:
            hosts = {address[0], self.server.host}
            if len(hosts) == 1 or hosts & {"0.0.0.0", "::", "*", ""}:
                raise ValueError(
                    f"metrics.listen {self.metrics.listen} takes the port the API is served on"
                    f" (server.host {self.server.host}, server.port {self.server.port}); give"
                    " the metrics listener a port of its own"
                )
        return self

    @model_validator(mode="after")
    def _pool_has_room(self) -> Config:
        # Below this the held connections take every slot, and requests and actors wait for
        # one forever: `serve` never got to serving with pool_max 1, and answered in tens of
        # seconds (health "degraded") with 2.
        held = self.held_connections
        if self.database.pool_max <= len(held):
            raise ValueError(
                f"database.pool_max must be at least {len(held) + 1} with this configuration:"
                f" {len(held)} connection(s) are held for the process's lifetime"
                f" ({', '.join(held)}) and requests need at least one more"
            )
        return self


# What a running process applies on SIGHUP (service/serve.py); every other key needs a restart.
RELOADABLE = frozenset({"federation.peers", "auth.admin_dids"})


def changed_keys(running: Config, fresh: Config) -> list[str]:
    """The keys (`section.key`) whose values differ between two configurations, sorted."""
    changed = []
    for section in Config.model_fields:
        before = getattr(running, section).model_dump()
        after = getattr(fresh, section).model_dump()
        changed += [f"{section}.{k}" for k in before if before[k] != after.get(k)]
    return sorted(changed)


ENV_PREFIX = "REGISTRY_"


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name or name == "REGISTRY_CONFIG":
            continue
        section, _, key = name[len(ENV_PREFIX) :].partition("__")
        section, key = section.lower(), key.lower()
        if section not in Config.model_fields:
            raise ConfigError(f"{name}: there is no [{section}] section")
        value: Any = raw
        if raw.startswith(("[", "{")):  # (not `raw[:1] in "[{"`: "" is in every string)
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{name}: not valid JSON ({exc.msg})") from None
        out.setdefault(section, {})[key] = value
    return out


def load_config(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """File < environment < `overrides` (the command-line flags)."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get("REGISTRY_CONFIG"):
        path = Path(environ["REGISTRY_CONFIG"])
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8
        except OSError as exc:
            raise ConfigError(
                f"{path}: cannot read the configuration file ({exc.strerror})"
            ) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8, as TOML requires"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc})") from None
    for layer in (_env_overrides(environ), overrides or {}):
        for section, values in layer.items():
            current = data.setdefault(section, {})
            if not isinstance(current, dict):
                raise ConfigError(f"[{section}] must be a table")
            current.update({k: v for k, v in values.items() if v is not None})
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False, include_input=False):
            where = ".".join(str(p) for p in err["loc"])
            reason = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            reason = reason.removeprefix("Value error, ")
            problems.append(f"{where}: {reason}" if where else reason)  # a rule across sections
        source = f" (from {path} and REGISTRY_* variables)" if path else ""
        raise ConfigError(
            "invalid configuration" + source + ":\n  " + "\n  ".join(problems)
        ) from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def sample_toml() -> str:
    """Every key of every section with its default, as a configuration file
    (`deploy/registry.toml`; regenerate it with `python -m registry.config`)."""
    defaults = Config()
    lines = [
        "# registry.toml: every key with its default. docs/configuration.md says what each means;",
        "# REGISTRY_<SECTION>__<KEY> variables and command-line flags override this file.",
        "# Generated from registry/config.py by `python -m registry.config` (a test compares).",
    ]
    for section in Config.model_fields:
        values = getattr(defaults, section)
        lines += ["", f"[{section}]"]
        for key in type(values).model_fields:
            value = getattr(values, key)
            if section == "federation" and key == "peers":
                lines += [
                    "# peers: one [[federation.peers]] table each (docs/federation.md), e.g.",
                    "#   [[federation.peers]]",
                    '#   peer_did = "did:key:z6Mk..."',
                    '#   endpoint = "https://peer.example"',
                ]
                continue
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(sample_toml(), end="")
