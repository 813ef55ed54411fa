"""Open an Optuna RDB storage with a clear error, and write a finished run into it in one transaction.

Why a bulk writer: ``Study.add_trials`` commits every trial separately and looks every attribute up
before inserting it (~0.1-0.2 s per trial with our ~25 user attributes on SQLite), which alone would
spend most of the 30 s budget of a 300-trial search. Writing the same rows through Optuna's own
SQLAlchemy models in one session is ~50× faster and atomic: either the whole run lands or nothing
does. The models are Optuna internals, so any failure (a schema change in a future Optuna) rolls
the transaction back and falls back to the public ``add_trials``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

from lightning_distplan.errors import DistPlanError, first_line

__all__ = [
    "StudyStorageError", "claim_study_without_attrs", "claims_studies", "create_study_with_attrs", "damage_problem", "delete_study_without_trials", "missing_driver_problem", "folder_problem", "missing_folder_problem", "is_sqlite", "open_storage", "read_only_problem", "sqlite_options", "sqlite_path", "sqlite_tables",
    "is_optuna_database", "schema_hint", "shown_url", "worker_slot", "write_trials",
]

log = logging.getLogger(__name__)


class StudyStorageError(DistPlanError, ValueError):
    """The Optuna storage URL is invalid or the database cannot be reached."""


_HINT = (
    "Use an RDB URL such as sqlite:///distplan.db (a file in an existing directory) or "
    "postgresql://user:pass@host/db, and check that the server is reachable and its driver installed."
)


def _parsed(url: Any) -> Any:
    """SQLAlchemy's reading of ``url`` (what Optuna will open), or None when it is no URL SQLAlchemy parses."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url) if isinstance(url, str) else None
    except Exception:  # noqa: BLE001 - ArgumentError / ValueError: not a URL; open_storage says so
        return None


def is_sqlite(url: Any) -> bool:
    """Whether ``url`` opens SQLite, under any driver (``sqlite://``, ``sqlite+pysqlite://``, ...)."""
    parsed = _parsed(url)
    return parsed is not None and parsed.get_backend_name() == "sqlite"


def sqlite_path(url: Any) -> Path | None:
    """The file a SQLite URL names, as SQLAlchemy reads it (any driver, percent-escapes decoded; relative after
    three slashes, absolute after four), else None (not SQLite, or an in-memory database)."""
    parsed = _parsed(url)
    if parsed is None or parsed.get_backend_name() != "sqlite":
        return None
    rest = parsed.database or ""
    if parsed.query.get("uri") == "true" and rest.startswith("file:"):  # a URI filename: the path follows "file:"
        rest = rest[len("file:") :]
        if rest.startswith("//"):  # an authority, which SQLite takes empty or "localhost" (file:///x, file://localhost/x)
            authority, slash, tail = rest[2:].partition("/")
            if authority in ("", "localhost"):
                rest = slash + tail
        from urllib.parse import unquote

        rest = unquote(rest.split("#", 1)[0])  # SQLite decodes %HH escapes of a URI filename and ends it at a fragment
    if not rest or rest == ":memory:":
        return None
    return Path(rest)


def sqlite_options(url: Any) -> dict[str, Any]:
    """The query options of a SQLite URL (``mode=ro``, ``immutable=1``, ...); empty for others."""
    parsed = _parsed(url)
    return dict(parsed.query) if parsed is not None and parsed.get_backend_name() == "sqlite" else {}


def _read_only(path: Path) -> Any:
    """A connection to an existing SQLite file that cannot write to it (closed on leaving the ``with``)."""
    import sqlite3

    return contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True))


def sqlite_tables(path: Path) -> list[str] | None:
    """The tables of an existing SQLite file, read without writing; None when it is no SQLite database."""
    import sqlite3

    try:
        with _read_only(path) as db:
            return sorted(row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    except sqlite3.DatabaseError:
        return None


def sqlite_damage(path: Path) -> str | None:
    """What SQLite's ``PRAGMA quick_check`` finds wrong in an existing file (read without writing), or None when
    it finds nothing. A file damaged past its first page still opens and lists its tables."""
    import sqlite3

    try:
        with _read_only(path) as db:
            found = [row[0] for row in db.execute("PRAGMA quick_check(3)")]
    except sqlite3.OperationalError:  # locked, or unreadable here (a WAL file in a read-only folder): not damage
        return None
    except sqlite3.DatabaseError as err:
        return str(err)
    return None if found == ["ok"] else " ".join("; ".join(found).split())  # one line


OPTUNA_TABLES = frozenset({"studies", "trials", "version_info"})
"""Tables every Optuna RDB schema has: a SQLite file with other tables but not all of these is someone else's."""


def is_optuna_database(path: Path) -> bool:
    """Whether an existing SQLite file holds Optuna's schema (read without writing)."""
    return OPTUNA_TABLES <= set(sqlite_tables(path) or ())


def foreign_database_problem(url: str) -> tuple[str, str] | None:
    """(message, hint) when a SQLite URL names an existing file that is not Optuna's: a database of other tables
    (a search would add Optuna's tables to the user's file) or no database at all."""
    path = sqlite_path(url)
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return None
    tables = sqlite_tables(path)
    if tables is None:
        return (f"The file {str(path)!r} named by the storage URL {url!r} is not an SQLite database (it was left unchanged).",
                "Name a new file for the studies, e.g. --storage sqlite:///distplan.db.")
    if tables and not OPTUNA_TABLES <= set(tables):
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        return (f"The SQLite file {str(path)!r} named by the storage URL {url!r} holds other tables ({shown}), not an Optuna "
                "study's; the search would add Optuna's tables to it (it was left unchanged).",
                "Name a file of its own for the studies, e.g. --storage sqlite:///distplan.db.")
    return None


def missing_folder_problem(url: str) -> tuple[str, str] | None:
    """(message, hint) when a SQLite URL names a file in a folder that does not exist: SQLite creates the file, not
    its folder, and says only "unable to open database file". A ``~`` is not expanded (SQLite takes it as a name)."""
    path = sqlite_path(url)
    if path is None or path.parent.is_dir():
        return None
    tilde = " (a ~ in a storage URL is not your home folder; write the path out)" if "~" in path.parts[0] else ""
    if tilde:
        home = Path.home() / Path(*path.parts[1:])
        hint = f"Write the path out, e.g. sqlite:///{home}."
    else:
        hint = f"Create the folder first (mkdir -p {str(path.parent)!r}), or name a file in an existing one, e.g. sqlite:///distplan.db."
    return (f"The folder {str(path.parent)!r} of the storage URL {url!r} does not exist{tilde}; SQLite creates the database file, not its folder.", hint)


def damage_problem(url: str) -> tuple[str, str] | None:
    """(message, hint) when a SQLite URL names an existing file that SQLite's ``quick_check`` finds damaged.

    A file damaged past its first page still opens and lists its tables, and a study that lies on undamaged pages
    still reads: without this check a search wrote a new study into it and reported success (writes into a damaged
    b-tree can spread the damage; the user heard nothing of it)."""
    path = sqlite_path(url)
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return None
    damage = sqlite_damage(path)
    if damage is None:
        return None
    return (
        f"The SQLite file {str(path)!r} named by the storage URL {shown_url(url)!r} is damaged (quick_check: {damage[:200]}); "
        "nothing was searched or written.",
        f"Keep a copy, then restore it from a backup or copy what is readable with `sqlite3 {path} .dump | sqlite3 recovered.db`, "
        "or pass another --storage.",
    )


def folder_problem(url: str) -> tuple[str, str] | None:
    """(message, hint) when a SQLite URL names a folder: SQLite only says "unable to open database file"."""
    path = sqlite_path(url)
    if path is None or not path.is_dir():
        return None
    return (
        f"The storage URL {url!r} names the folder {str(path)!r}, not an SQLite file.",
        f"Name the database file in it, e.g. sqlite:///{path / 'distplan.db'}.",
    )


def read_only_problem(url: str) -> str | None:
    """Why a SQLite URL cannot take writes (checked before a search, so it fails in a second, not after it), or None.

    SQLite writes a journal next to the database, so the folder must be writable as well as the file.
    """
    path = sqlite_path(url)
    if path is None:
        return None
    options = sqlite_options(url)
    if options.get("mode") == "ro" or options.get("immutable") == "1":
        return f"The storage URL {url!r} opens the database read-only, and a search writes its trials."
    folder = path.parent
    if path.exists() and not os.access(path, os.W_OK):
        return f"The SQLite file {str(path)!r} of --storage {url!r} is read-only for this user."
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        return f"The folder {str(folder)!r} of --storage {url!r} is read-only for this user, and SQLite writes its journal there."
    return None


@contextlib.contextmanager
def _sqlite_creation_lock(url: str) -> Any:
    """Hold an exclusive lock on the SQLite file's folder while Optuna opens it: two runs creating one new file
    at once otherwise both create Optuna's schema, and one fails ("table ... already exists", "UNIQUE constraint
    failed").

    The lock is on the folder, not the database (closing a descriptor of the database would drop SQLite's own
    locks held by this process) and not on a lock file of our own (one per database, left behind in the
    temporary folder: a test suite made thousands). Runs opening other databases in the same folder wait for
    each other for the second or so an open takes. Where the folder cannot be locked (one this user may write
    but not read, an NFS mount, whose flock needs a descriptor open for writing) the lock is a file of its own
    in the temporary folder, keyed by the database's path, left there; where neither can be had (not POSIX)
    the open goes on without one, which is Optuna's own behaviour."""
    folder = _lock_folder(url)
    try:
        yield
    finally:
        if folder is not None:
            import fcntl

            fcntl.flock(folder, fcntl.LOCK_UN)
            os.close(folder)


def _lock_folder(url: str) -> int | None:
    """A descriptor of the SQLite file's folder (else of its lock file in the temporary folder), exclusively
    locked; None where there is no file or no lock."""
    path = sqlite_path(url)
    try:
        import fcntl
    except ImportError:
        return None
    if path is None:
        return None
    parent = path.expanduser().resolve().parent
    if not parent.is_dir():  # no such folder: SQLite's own error follows
        return None
    for opened in (_open_folder, _open_lock_file):
        try:
            handle = opened(parent, path)
        except OSError:  # a folder this user cannot read; a lock file of another user's, a full disk
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system whose flock refuses this descriptor (NFS: a folder, open read-only)
            os.close(handle)
            continue
        return handle
    return None


def _open_folder(parent: Path, path: Path) -> int:
    return os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _open_lock_file(parent: Path, path: Path) -> int:
    """The lock file of the database at ``path`` in the temporary folder (where its folder cannot be locked)."""
    return os.open(_temp_lock_path("sqlite", str(parent / path.name)), os.O_RDWR | os.O_CREAT, 0o666)


def _temp_lock_path(kind: str, what: str, suffix: str = "") -> Path:
    """``distplan-<kind>-<hash of what><suffix>.lock`` in the temporary folder: a lock file every run of this user's
    machine that locks ``what`` names alike."""
    import hashlib
    import tempfile

    key = hashlib.sha256(what.encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / f"distplan-{kind}-{key}{suffix}.lock"


@contextlib.contextmanager
def worker_slot(url: str, study_name: str) -> Any:
    """Yield this run's worker number on study ``study_name`` of ``url``: the lowest k that no other run on this
    machine holds for that study (0 for a run alone), held until the block ends.

    Workers of one search started at once all see the same study (none, or the same trials) when they start, so
    nothing in the database sets them apart; a run's number is what makes its draws its own. Each k is an exclusive
    flock on a file of its own in the temporary folder, keyed by the database (its resolved path for SQLite, else the
    URL less its password) and the study name, and removed by the run that held it (a killed run's is freed by the
    kernel and taken again); a k whose file cannot be opened (another user's) is passed over, as taken. 0 where there
    is no flock (not POSIX) or no temporary folder to write."""
    try:
        import fcntl
    except ImportError:
        yield 0
        return
    path = sqlite_path(url)
    where = str(path.expanduser().resolve()) if path is not None else shown_url(url)
    held = None
    k = 0
    while held is None and k < 1024:
        lock = _temp_lock_path("worker", f"{where}\0{study_name}", f"-{k}")
        try:
            handle = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            if not os.path.lexists(lock):  # no temporary folder to write: as a run alone
                break
            k += 1  # a lock file of another user's: k is neither ours nor free
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another run holds k
            os.close(handle)
            k += 1
            continue
        try:
            same = os.stat(lock).st_ino == os.fstat(handle).st_ino
        except OSError:
            same = False
        if same:
            held = (lock, handle)
        else:  # its holder removed the file between our open and our lock: take k anew
            os.close(handle)
    try:
        yield k if held is not None else 0
    finally:
        if held is not None:
            with contextlib.suppress(OSError):
                os.unlink(held[0])  # while still locked: a run that opened it meanwhile sees another file and retries
            os.close(held[1])


def open_storage(url: Any) -> Any:
    """An ``optuna.storages.RDBStorage`` for ``url``, or :class:`StudyStorageError` naming what is wrong."""
    import optuna

    if not isinstance(url, str) or "://" not in url:
        raise StudyStorageError(f"Storage {shown_url(url)!r} is not a database URL.", hint=_HINT)
    folder = folder_problem(url)
    if folder is not None:
        raise StudyStorageError(folder[0], hint=folder[1])
    if is_sqlite(url) and sqlite_path(url) is None:
        host = _parsed(url).host
        if host:  # sqlite://distplan.db: the name went where a server would
            raise StudyStorageError(
                f"The storage URL {url!r} names {host!r} as a server; a SQLite URL names its file after three slashes.",
                hint=f"Use sqlite:///{host} (a file here) or sqlite:////absolute/path/{host}.",
            )
        raise StudyStorageError(
            f"The storage URL {url!r} is an in-memory SQLite database, which vanishes with this process, study and all.",
            hint="Name a file, e.g. --storage sqlite:///distplan.db.",
        )
    missing = missing_folder_problem(url)
    if missing is not None:
        raise StudyStorageError(missing[0], hint=missing[1])
    problem = None
    try:
        # SQLite lets one writer in at a time: a second `tune` extending the same study waits for the first's
        # trials (a bulk insert of thousands takes seconds) instead of failing after pysqlite's 5 s.
        engine = {"connect_args": {"timeout": 300}} if is_sqlite(url) else None
        with _sqlite_creation_lock(url):
            # Looked at under the lock: a file another run is creating Optuna's schema in has some of its tables
            # until that run is done, and was refused as someone else's database ("holds other tables (studies)").
            problem = foreign_database_problem(url) or damage_problem(url)
            read_only = None if problem is not None else read_only_problem(url)
            if read_only is not None:
                problem = (read_only, "Pass a --storage this user can write (a SQLite file in a writable folder), or make the file writable.")
            if problem is None:
                storage = optuna.storages.RDBStorage(url, engine_kwargs=engine)
                storage.get_all_studies()  # a real round trip: the database answers and has Optuna's schema
    except Exception as err:  # sqlalchemy ArgumentError / OperationalError, a missing driver: all mean "cannot use it"
        driver = missing_driver_problem(err, url)
        if driver is not None:
            raise StudyStorageError(driver[0], hint=driver[1]) from None
        raise StudyStorageError(
            f"Cannot open the study storage {shown_url(url)!r} ({type(err).__name__}: {first_line(err)[:200]}).", hint=schema_hint(err, url) or _HINT
        ) from None
    if problem is not None:
        raise StudyStorageError(problem[0], hint=problem[1])
    return storage


# source: the SQLAlchemy 2.x dialect pages (docs.sqlalchemy.org/en/20/dialects/postgresql.html, mysql.html, sqlite.html)
DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "psycopg": "'psycopg[binary]'", "MySQLdb": "mysqlclient", "pymysql": "PyMySQL",
                   "mysql": "mysql-connector-python", "pysqlcipher3": "sqlcipher3-binary"}
"""Database driver module -> the pip package that installs it, where the two names differ."""


def missing_driver_problem(err: BaseException, url: str) -> tuple[str, str] | None:
    """(message, hint) when opening ``url`` failed because its database driver is not installed, naming the module and
    the pip package. Optuna says only "Failed to import DB access module for the specified storage URL. Please install
    appropriate one." (its ImportError, caused by the driver's ModuleNotFoundError)."""
    if not isinstance(err, ImportError):  # Optuna's "Failed to import DB access module", or the driver's own error
        return None
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ModuleNotFoundError):
        cause = cause.__cause__ or cause.__context__
    if cause is None or not getattr(cause, "name", None):
        return None
    module = cause.name.split(".")[0]
    return (f"Cannot open the study storage {shown_url(url)!r}: its database driver {module!r} is not installed.",
            f"Install it (pip install {DRIVER_PACKAGES.get(module, module)}), or use a SQLite URL such as sqlite:///distplan.db.")


def schema_hint(err: BaseException, url: str) -> str | None:
    """The HINT for Optuna's refusal of a database whose schema another Optuna version set up (a study file from an
    older or newer install), or None for any other error. The generic storage HINT (check the URL, the server, the
    driver) sent users with a readable study file looking for a fault it does not have."""
    if not isinstance(err, RuntimeError) or "compatible with the table schema" not in str(err):
        return None
    import optuna

    if "optuna storage upgrade" in str(err):  # Optuna knows the schema: an older version's
        return (f"The study database was set up by an older Optuna than this one ({optuna.__version__}): keep a copy of it, then "
                f"upgrade its schema with `optuna storage upgrade --storage {shown_url(url)}`; or pass another --storage.")
    return (f"The study database was set up by a newer Optuna than this one ({optuna.__version__}): use that version "
            "(pip install -U optuna), or pass another --storage.")


_USER_PASSWORD = re.compile(r"^(?P<head>[^:/?#]+://[^:/?#@]*:).*@", re.DOTALL)
"""``scheme://user:`` and everything up to the URL's last ``@``: the widest span a password can take."""


def shown_url(url: str) -> str:
    """``url`` as messages and results show it: a password in it replaced by ``***`` (SQLAlchemy's rendering).

    A URL SQLAlchemy cannot read (a port that is no number) or one whose password holds an unescaped ``@`` (SQLAlchemy
    ends the password at the first ``@`` and takes the rest of it for the host) has everything from ``user:`` to its
    last ``@`` hidden instead: either way no part of the password is shown."""
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: shown as typed (the error says so), less a password
        parsed = None
    if parsed is None or "@" in (parsed.host or ""):
        return _USER_PASSWORD.sub(r"\g<head>***@", url) if isinstance(url, str) else url
    return parsed.render_as_string(hide_password=True) if parsed.password else url


def write_trials(study: Any, trials: Sequence[Any]) -> None:
    """Append finished ``trials`` (FrozenTrial) to ``study`` (backed by an RDBStorage), atomically."""
    if not trials:
        return
    storage = study._storage
    rdb = getattr(storage, "_backend", storage)  # optuna wraps RDBStorage in _CachedStorage
    from sqlalchemy.exc import SQLAlchemyError

    try:
        _bulk_insert(rdb, study._study_id, trials)
    except SQLAlchemyError:
        # The database refused the write (disk full, I/O error, locked): the transaction was rolled back, so nothing
        # of this run is in the study. Never retried trial by trial: that would leave part of the run there.
        raise
    except Exception as err:  # noqa: BLE001 - an internal mismatch with this Optuna (no row written): the public API
        log.info("Bulk trial insert unavailable (%s: %s); using Study.add_trials.", type(err).__name__, err)
        study.add_trials(trials)


def create_study_with_attrs(storage: Any, study_name: str, directions: Sequence[Any], user_attrs: dict[str, Any]) -> bool:
    """Create study ``study_name`` in ``storage`` (an RDBStorage) with its ``directions`` (``StudyDirection``) and
    ``user_attrs`` in one transaction; True when it did, False (nothing written) where this Optuna's models do not fit
    and the caller creates it through the public API.

    Why: created first and given its attributes after (``optuna.create_study``, then ``set_user_attr``), a study is
    for a moment without them, so a run that finds a study of its name without distplan's settings cannot tell someone
    else's from one another worker is still setting up, and waited 30 s before refusing. Created whole, a study of this
    version never lacks them.

    Raises:
        optuna.exceptions.DuplicatedStudyError: a study of that name exists.
        sqlalchemy.exc.SQLAlchemyError: the database refused the write (rolled back)."""
    import optuna
    from sqlalchemy.exc import IntegrityError, SQLAlchemyError

    rdb = getattr(storage, "_backend", storage)  # optuna wraps RDBStorage in _CachedStorage
    try:
        from optuna.storages._rdb import models

        session = rdb.scoped_session()
    except Exception as err:  # noqa: BLE001 - an internal mismatch with this Optuna: the public API
        log.info("Creating a study in one transaction is unavailable (%s: %s); using optuna.create_study.", type(err).__name__, err)
        return False
    try:
        study = models.StudyModel(
            study_name=study_name, directions=[models.StudyDirectionModel(objective=i, direction=d) for i, d in enumerate(directions)]
        )
        session.add(study)
        session.flush()  # the unique name: IntegrityError when it is taken; assigns study.study_id
        for key, value in user_attrs.items():
            session.add(models.StudyUserAttributeModel(study_id=study.study_id, key=key, value_json=json.dumps(value)))
        session.commit()
        return True
    except IntegrityError:  # as Optuna's own create_new_study reads it
        session.rollback()
        raise optuna.exceptions.DuplicatedStudyError(f"Another study with name '{study_name}' already exists.") from None
    except SQLAlchemyError:
        session.rollback()
        raise
    except Exception as err:  # noqa: BLE001 - an internal mismatch with this Optuna (rolled back): the public API
        session.rollback()
        log.info("Creating a study in one transaction is unavailable (%s: %s); using optuna.create_study.", type(err).__name__, err)
        return False
    finally:
        session.close()


def creates_studies_whole(storage: Any) -> bool:
    """Whether :func:`create_study_with_attrs` fits this Optuna (it builds its study and attribute rows), found without
    writing anything: True where a run of this version creates its study with its settings in one transaction.

    Why: a run that finds its study without attributes or trials waits for its settings only where runs create studies
    through Optuna's public API (first the study, its attributes after); where they are created whole, such a study is
    someone else's (``optuna create-study``), and waiting for it delayed its refusal by seconds for nothing. Workers of
    one command run one Optuna, so a run's answer here is its creator's. A mismatch only the database shows (a flush
    error) still falls back at the create; that run's other workers then refuse the study as before."""
    try:
        import optuna
        from optuna.storages._rdb import models

        rdb = getattr(storage, "_backend", storage)  # optuna wraps RDBStorage in _CachedStorage
        if not callable(getattr(rdb, "scoped_session", None)):
            return False
        # built, never added to a session: the same constructor calls create_study_with_attrs makes
        models.StudyModel(study_name="", directions=[models.StudyDirectionModel(objective=0, direction=optuna.study.StudyDirection.MINIMIZE)])
        models.StudyUserAttributeModel(study_id=0, key="", value_json="null")
    except Exception:  # noqa: BLE001 - an internal mismatch with this Optuna: studies are made through the public API
        return False
    return True


def _locked_study(session: Any, models: Any, study_name: str) -> Any:
    """Study ``study_name``'s row, locked for this transaction, or None where there is none. PostgreSQL / MySQL: the
    row lock (which _bulk_insert takes too). SQLite has no row locks and pysqlite begins a transaction only at a write:
    the no-op UPDATE makes this the database's one writer. It names the study as well as its id: the read before it
    takes no lock on SQLite, and a study deleted and made again in between may reuse the id (locked by id alone, a
    claim wrote into that other study and a delete removed it)."""
    study = session.query(models.StudyModel).filter(models.StudyModel.study_name == study_name).with_for_update().one_or_none()
    if study is None:
        return None
    locked = session.query(models.StudyModel).filter(
        models.StudyModel.study_id == study.study_id, models.StudyModel.study_name == study_name
    ).update({models.StudyModel.study_name: study_name}, synchronize_session=False)
    return study if locked else None


def claim_study_without_attrs(storage: Any, study_name: str, directions: Sequence[Any], user_attrs: dict[str, Any], *,
                              just_created: bool = False) -> bool | None:
    """Give study ``study_name`` of ``storage`` (an RDBStorage) ``user_attrs``, in one transaction, if it is still as
    a run creating it through Optuna's public API leaves it before its first ``set_user_attr``: no trial, no user or
    system attribute, and ``directions`` (``StudyDirection``). True when it did; False (nothing written) when the study
    is gone or not so (another run claimed it meanwhile, or it is someone else's); None (nothing written) where this
    Optuna's models do not fit.

    Why: such a study is what a creator killed between the two leaves behind (with an Optuna whose models do not fit
    :func:`create_study_with_attrs`), and every re-run refused it. It holds nothing of anyone's, so a run adopts it; the
    check and the write are one transaction, so two runs adopting it at once, or an adopter and a slow creator, never
    both write their settings into it: the second finds it claimed.

    ``just_created``: the caller created the study a moment ago through the public API; only its user attributes are
    checked (a claim by another run writes them), so an Optuna whose ``create_study`` writes system attributes or a
    first trial of its own does not make the run take its own study for another's.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database refused the write (rolled back)."""
    from sqlalchemy.exc import SQLAlchemyError

    rdb = getattr(storage, "_backend", storage)  # optuna wraps RDBStorage in _CachedStorage
    try:
        from optuna.storages._rdb import models

        session = rdb.scoped_session()
    except Exception as err:  # noqa: BLE001 - an internal mismatch with this Optuna
        log.info("Claiming a study in one transaction is unavailable (%s: %s).", type(err).__name__, err)
        return None
    try:
        # this the database's one writer for the study before the checks (_locked_study)
        study = _locked_study(session, models, study_name)
        if study is None:
            session.rollback()
            return False
        held = any(
            session.query(model).filter(model.study_id == study.study_id).first() is not None
            for model in ((models.StudyUserAttributeModel,) if just_created
                          else (models.TrialModel, models.StudyUserAttributeModel, models.StudySystemAttributeModel))
        )
        stored = [d.direction for d in sorted(study.directions, key=lambda d: d.objective)]
        if held or stored != list(directions):
            session.rollback()
            return False
        for key, value in user_attrs.items():
            session.add(models.StudyUserAttributeModel(study_id=study.study_id, key=key, value_json=json.dumps(value)))
        session.commit()
        return True
    except SQLAlchemyError:
        session.rollback()
        raise
    except Exception as err:  # noqa: BLE001 - an internal mismatch with this Optuna (rolled back)
        session.rollback()
        log.info("Claiming a study in one transaction is unavailable (%s: %s).", type(err).__name__, err)
        return None
    finally:
        session.close()


def claims_studies(storage: Any) -> bool:
    """Whether :func:`claim_study_without_attrs` fits this Optuna (found without writing anything): a run that would
    adopt a study asks before its search, so one that cannot is refused in a second, not after the search."""
    try:
        from optuna.storages._rdb import models

        rdb = getattr(storage, "_backend", storage)  # optuna wraps RDBStorage in _CachedStorage
        if not callable(getattr(rdb, "scoped_session", None)):
            return False
        for model in (models.StudyModel, models.TrialModel, models.StudyUserAttributeModel, models.StudySystemAttributeModel):
            model.study_id  # noqa: B018 - the columns the claim reads
        # and the name and directions it checks (an Optuna whose StudyModel / StudyDirectionModel changed is the one that
        # makes create_study_with_attrs fall back: the claim would fail only at the write, after the whole search)
        models.StudyModel.study_name, models.StudyModel.directions  # noqa: B018
        models.StudyDirectionModel.direction, models.StudyDirectionModel.objective  # noqa: B018
        models.StudyUserAttributeModel(study_id=0, key="", value_json="null")  # built, never added to a session
    except Exception:  # noqa: BLE001 - an internal mismatch with this Optuna
        return False
    return True


def delete_study_without_trials(storage: Any, study_name: str) -> bool:
    """Delete study ``study_name`` from ``storage`` (an RDBStorage) if it holds no trial; True when it did.

    The check and the delete are one transaction that no other run's write of trials can fall between: a run that
    created a study and failed to write its own trials removes it, never the trials another run added meanwhile.
    Checked first and deleted after (``get_all_trials``, then ``optuna.delete_study``), a run's trials committed in
    between went with the study while that run reported them written."""
    from optuna.storages._rdb import models

    rdb = getattr(storage, "_backend", storage)  # optuna wraps RDBStorage in _CachedStorage
    session = rdb.scoped_session()
    try:
        # this the database's one writer for the study before the count (_locked_study)
        study = _locked_study(session, models, study_name)
        if study is None:
            session.rollback()
            return False
        if session.query(models.TrialModel.trial_id).filter(models.TrialModel.study_id == study.study_id).first() is not None:
            session.rollback()
            return False
        session.delete(study)
        session.commit()
        return True
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _bulk_insert(rdb: Any, study_id: int, trials: Sequence[Any]) -> None:
    from optuna import distributions
    from optuna.storages._rdb import models

    session = rdb.scoped_session()
    try:
        models.StudyModel.find_or_raise_by_id(study_id, session, for_update=True)  # locks the study row (not on SQLite)
        first: int | None = None
        for i, t in enumerate(trials):
            row = models.TrialModel(
                study_id=study_id,
                number=0 if first is None else first + i,
                state=t.state,
                datetime_start=t.datetime_start,
                datetime_complete=t.datetime_complete,
            )
            session.add(row)
            session.flush()  # assigns row.trial_id
            tid = row.trial_id
            if first is None:
                # Numbered after our first insert, as Optuna numbers its trials: on SQLite that insert waits for
                # another run's write to commit, so its trials are counted (counted before, two runs extending one
                # study at once both numbered from the same count, and Optuna then showed half the trials).
                first = session.query(models.TrialModel).filter(
                    models.TrialModel.study_id == study_id, models.TrialModel.trial_id < tid
                ).count()
                row.number = first
                # ...and the study is looked up again: on SQLite the lookup above ran before this transaction, and a
                # run that deleted the study meanwhile (delete_study_without_trials) left these trials in no study
                models.StudyModel.find_or_raise_by_id(study_id, session)
            values = t.values if t.values is not None else []
            for objective, value in enumerate(values):
                stored, kind = models.TrialValueModel.value_to_stored_repr(value)
                session.add(models.TrialValueModel(trial_id=tid, objective=objective, value=stored, value_type=kind))
            for name, value in t.params.items():
                dist = t.distributions[name]
                session.add(
                    models.TrialParamModel(
                        trial_id=tid, param_name=name, param_value=dist.to_internal_repr(value), distribution_json=distributions.distribution_to_json(dist)
                    )
                )
            for key, value in t.user_attrs.items():
                session.add(models.TrialUserAttributeModel(trial_id=tid, key=key, value_json=json.dumps(value)))
            for key, value in t.system_attrs.items():
                session.add(models.TrialSystemAttributeModel(trial_id=tid, key=key, value_json=json.dumps(value)))
            for step, value in t.intermediate_values.items():
                stored, kind = models.TrialIntermediateValueModel.intermediate_value_to_stored_repr(value)
                session.add(models.TrialIntermediateValueModel(trial_id=tid, step=step, intermediate_value=stored, intermediate_value_type=kind))
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
