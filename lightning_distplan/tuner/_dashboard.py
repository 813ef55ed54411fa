"""optuna-dashboard glue: optional-dependency gates, storage checks, and a stoppable server.

The optional packages of the ``dashboard`` extra (optuna-dashboard, plotly, matplotlib) are
checked here and nowhere else (STYLE rule 8), each with the exact install command in the error.

The server is optuna-dashboard's own WSGI app (:func:`optuna_dashboard.wsgi`) under the standard
library's threaded ``wsgiref`` server, the same pairing optuna-dashboard's console script uses when
gunicorn is absent. We build it ourselves instead of calling :func:`optuna_dashboard.run_server`
because that one serves one request at a time and cannot be stopped from Python: a browser
loading the SPA opens several connections at once, and tests must shut the server down.
"""

from __future__ import annotations

import errno
import importlib
import logging
import socket
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from lightning_distplan.errors import DistPlanError, first_line
from lightning_distplan.tuner._storage import folder_problem, is_optuna_database, missing_driver_problem, schema_hint, shown_url, sqlite_damage, sqlite_path

if TYPE_CHECKING:
    from types import ModuleType

    from optuna.storages import BaseStorage

__all__ = [
    "MissingDependencyError",
    "StorageUnreachableError",
    "DashboardServer",
    "require",
    "open_storage",
    "default_artifact_dir",
    "LOOPBACK_HOSTS",
]

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

_INSTALL = 'pip install "lightning_distplan[dashboard]"'
# module name -> (distribution name, minimum version that has the API we call)
_OPTIONAL = {
    # optuna_dashboard.wsgi(storage, artifact_store=...) and save_plotly_graph_object: 0.16+
    "optuna_dashboard": ("optuna-dashboard", "0.16"),
    "plotly": ("plotly", "5.20"),
    "matplotlib": ("matplotlib", "3.8"),
}


class MissingDependencyError(DistPlanError, ImportError):
    """An optional package of the ``dashboard`` extra is not installed."""


class StorageUnreachableError(DistPlanError, RuntimeError):
    """The Optuna storage URL cannot be opened or holds no study."""


def require(module: str) -> ModuleType:
    """Import an optional dependency of the ``dashboard`` extra or raise with the install command.

    Args:
        module: ``"optuna_dashboard"``, ``"plotly"`` or ``"matplotlib"``.

    Raises:
        MissingDependencyError: the package is not importable.
    """
    dist, minimum = _OPTIONAL[module]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            f"The optional package {dist!r} (>= {minimum}) is not installed, and this feature needs it.",
            hint=f"Run `{_INSTALL}` (or `pip install '{dist}>={minimum}'`).",
        ) from None


def default_artifact_dir(storage_url: str) -> Path | None:
    """Where study artifacts (PNG plots) live by default: ``<db dir>/<db stem>-artifacts`` for SQLite.

    Both :func:`lightning_distplan.tuner.plots.attach_to_study` and ``distplan dashboard`` use it,
    so plots attached after ``distplan tune`` are served without any flag. Other storages have no
    natural place next to them and return None (pass ``--artifact-dir``).
    """
    path = sqlite_path(storage_url)
    if path is None:
        return None
    return path.with_name(path.stem + "-artifacts")


def open_storage(storage_url: str) -> BaseStorage:
    """Open an Optuna RDB storage that already holds at least one study.

    A SQLite URL naming a missing file is refused instead of silently creating an empty database
    (optuna would), since a dashboard over nothing is always a typo.

    Raises:
        StorageUnreachableError: the file is missing or damaged, the database cannot be opened, or
            it holds no study.
    """
    import optuna

    path = sqlite_path(storage_url)
    folder = folder_problem(storage_url)
    if folder is not None:
        raise StorageUnreachableError(folder[0], hint=folder[1])
    if path is not None and not path.is_file():
        raise StorageUnreachableError(
            f"The SQLite file {str(path)!r} named by the storage URL {storage_url!r} does not exist.",
            hint="Check the path (sqlite:/// + a relative path, sqlite://// + an absolute one), or create a study with `distplan tune --storage URL`.",
        )
    if path is not None and not is_optuna_database(path):
        # RDBStorage would create Optuna's tables in it: never write into a database that is not a study's
        raise StorageUnreachableError(
            f"The SQLite file {str(path)!r} named by {storage_url!r} holds no Optuna study (it was left unchanged).",
            hint="Name the database `distplan tune --storage` wrote, e.g. sqlite:///distplan.db.",
        )
    damage = sqlite_damage(path) if path is not None else None
    if damage is not None:
        # optuna-dashboard would serve pages that fail one by one, and write notes into the damaged file
        raise StorageUnreachableError(
            f"The SQLite file {str(path)!r} named by {storage_url!r} is damaged (quick_check: {damage[:200]}); nothing was served or written.",
            hint=f"Keep a copy, then restore the study from a backup or copy what is readable with `sqlite3 {path} .dump | sqlite3 recovered.db` and serve sqlite:///recovered.db.",
        )
    try:
        storage = optuna.storages.RDBStorage(storage_url, skip_compatibility_check=False)
        summaries = storage.get_all_studies()
    except Exception as err:  # sqlalchemy raises many kinds (ArgumentError, OperationalError, ...)
        driver = missing_driver_problem(err, storage_url)
        if driver is not None:
            raise StorageUnreachableError(driver[0], hint=driver[1]) from None
        raise StorageUnreachableError(
            f"Cannot open the Optuna storage {shown_url(storage_url)!r} ({type(err).__name__}: {first_line(err)}).",
            hint=schema_hint(err, storage_url)
            or "Pass an RDB URL such as sqlite:///distplan.db that `distplan tune --storage` wrote, and check the database server is reachable.",
        ) from None
    if not summaries:
        raise StorageUnreachableError(
            f"The Optuna storage {shown_url(storage_url)!r} holds no study.",
            hint="Run `distplan tune ... --storage URL --study-name NAME` first.",
        )
    return storage


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("dashboard: " + format, *args)


class _ThreadedWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a browser's keep-alive connection must not block shutdown


class _ThreadedWSGIServerV6(_ThreadedWSGIServer):
    address_family = socket.AF_INET6


class DashboardServer:
    """optuna-dashboard over one storage, served on ``host:port`` until :meth:`shutdown`.

    Example:
        >>> with DashboardServer("sqlite:///distplan.db", port=0) as server:  # doctest: +SKIP
        ...     print(server.url)             # served from a background thread
    """

    def __init__(self, storage_url: str, *, host: str = "127.0.0.1", port: int = 8080, artifact_dir: str | Path | None = None) -> None:
        optuna_dashboard = require("optuna_dashboard")
        storage = open_storage(storage_url)
        artifact_store = None
        if artifact_dir is None:
            guess = default_artifact_dir(storage_url)
            artifact_dir = guess if guess is not None and guess.is_dir() else None
        elif not Path(artifact_dir).is_dir():
            raise DashboardBindError(
                f"--artifact-dir {str(artifact_dir)!r} is not an existing directory.",
                hint="Name the folder of the study's plot artifacts (`distplan tune --plots` writes <db stem>-artifacts next to the SQLite file), or leave the flag out.",
            )
        if artifact_dir is not None:
            from optuna.artifacts import FileSystemArtifactStore

            artifact_store = FileSystemArtifactStore(str(artifact_dir))
        self.artifact_dir = Path(artifact_dir) if artifact_dir is not None else None
        app = optuna_dashboard.wsgi(storage, artifact_store=artifact_store)
        server_class = _ThreadedWSGIServerV6 if ":" in host else _ThreadedWSGIServer
        try:
            self._httpd = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
        except OSError as err:
            in_use = err.errno == errno.EADDRINUSE
            raise DashboardBindError(
                f"Cannot listen on {host}:{port} ({err.strerror or err}).",
                hint="Pick another port with --port (0 picks a free one), or stop the process that holds it."
                if in_use
                else "Check --host: it must be an address of this machine (default 127.0.0.1; 0.0.0.0 for all).",
            ) from None
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/dashboard/"

    def serve_forever(self) -> None:
        """Serve in the calling thread until :meth:`shutdown` (from another thread) or Ctrl-C."""
        try:
            self._httpd.serve_forever(poll_interval=0.2)
        finally:
            self._httpd.server_close()

    def start(self) -> DashboardServer:
        """Serve from a daemon thread and return at once."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="distplan-dashboard", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> DashboardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class DashboardBindError(DistPlanError, OSError):
    """The dashboard cannot listen on the requested host and port."""
