"""`distplan dashboard URL`: serves the study over HTTP on loopback; bad input is one line + HINT."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _synthetic_study import SMALL, make_study  # noqa: E402

from lightning_distplan.cli import main  # noqa: E402

pytest.importorskip("optuna_dashboard")


def test_cli_serves_study_api_spa_and_artifacts(tmp_path: Path) -> None:
    import optuna

    from lightning_distplan.tuner.plots import attach_to_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tmp_path / "tune.db"
    study = make_study(f"sqlite:///{db}", study_name="cli-study", **SMALL)
    stored = attach_to_study(study)
    assert stored["artifact_dir"] == str(tmp_path / "tune-artifacts")
    # through the console script's entry point, as `distplan dashboard` runs: there it imports neither torch nor
    # Lightning (`python -m lightning_distplan.cli` imports both first); the same main serves the study
    child = "import sys, _distplan_cli\nsys.argv[0] = 'distplan'\nsys.exit(_distplan_cli.main())\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", child, "dashboard", f"sqlite:///{db}", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        line = proc.stdout.readline()  # printed after the socket is bound
        match = re.search(r"at (http://127\.0\.0\.1:(\d+)/dashboard/)", line)
        assert match, f"unexpected output {line!r}"
        assert "artifacts from" in line and "tune-artifacts" in line  # picked up without a flag
        base = match.group(1).removesuffix("dashboard/")
        with urllib.request.urlopen(base + "api/studies", timeout=20) as resp:
            studies = resp.read().decode()
        assert '"study_name": "cli-study"' in studies
        with urllib.request.urlopen(base + "dashboard/", timeout=20) as resp:
            assert "bundle.js" in resp.read().decode()  # the SPA shell
        artifact_id = stored["artifact_ids"][0]
        with urllib.request.urlopen(f"{base}artifacts/{study._study_id}/{artifact_id}", timeout=20) as resp:
            assert resp.read(8) == b"\x89PNG\r\n\x1a\n"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_cli_missing_sqlite_file_is_one_line_with_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.db"
    assert main(["dashboard", f"sqlite:///{missing}", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "HINT:" in err and len(err.strip().splitlines()) == 1
    assert main(["dashboard", f"sqlite+pysqlite:///{missing}", "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not missing.exists()  # not silently created
    assert main(["dashboard", f"sqlite:///{tmp_path}", "--port", "0"]) == 2  # a folder, not a file
    err = capsys.readouterr().err
    assert "names the folder" in err and f"sqlite:///{tmp_path / 'distplan.db'}" in err and len(err.strip().splitlines()) == 1


def test_cli_unreachable_and_empty_storage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.db"
    bad.write_text("not a database")
    assert main(["dashboard", f"sqlite:///{bad}", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "holds no Optuna study (it was left unchanged)" in err and "HINT:" in err
    assert bad.read_text() == "not a database"
    import sqlite3

    other = tmp_path / "myapp.db"  # someone's own database: not one byte of Optuna's schema goes into it
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE users (name TEXT)")
    db.close()
    before = other.read_bytes()
    for url in (f"sqlite:///{other}", f"sqlite+pysqlite:///{other}"):  # any driver: still the user's file
        assert main(["dashboard", url, "--port", "0"]) == 2
        assert "holds no Optuna study" in capsys.readouterr().err and other.read_bytes() == before
    named = tmp_path / "named.db"  # the user's own table happens to be called `studies`
    with contextlib.closing(sqlite3.connect(named)) as db:
        db.execute("CREATE TABLE studies (name TEXT)")
        db.commit()
    before = named.read_bytes()
    assert main(["dashboard", f"sqlite:///{named}", "--port", "0"]) == 2
    assert "holds no Optuna study" in capsys.readouterr().err and named.read_bytes() == before
    assert main(["dashboard", "nosuchdialect://host/db", "--port", "0"]) == 2
    assert "Cannot open the Optuna storage" in capsys.readouterr().err
    import optuna

    empty = tmp_path / "empty.db"
    optuna.storages.RDBStorage(f"sqlite:///{empty}")  # schema, no study
    assert main(["dashboard", f"sqlite:///{empty}", "--port", "0"]) == 2
    assert "holds no study" in capsys.readouterr().err


def test_cli_port_in_use_and_out_of_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    db = tmp_path / "s.db"
    make_study(f"sqlite:///{db}", study_name="s", instances=("gn6i.xlarge",), counts=(1,), micro_batch_sizes=(4,))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["dashboard", f"sqlite:///{db}", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"Cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert main(["dashboard", f"sqlite:///{db}", "--port", "70000"]) == 2
    assert "--port must be in 0..65535, got 70000" in capsys.readouterr().err
    missing = tmp_path / "no" / "such"
    assert main(["dashboard", f"sqlite:///{db}", "--port", "0", "--artifact-dir", str(missing)]) == 2
    assert "is not an existing directory. HINT:" in capsys.readouterr().err
    assert not missing.parent.exists()  # a reading command creates nothing


def test_missing_optuna_dashboard_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_distplan.tuner._dashboard import MissingDependencyError, require

    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)  # what an uninstalled package looks like to import
    with pytest.raises(MissingDependencyError, match=r"'optuna-dashboard'.*not installed.*HINT: Run `pip install \"lightning_distplan\[dashboard\]\"`") as info:
        require("optuna_dashboard")
    assert isinstance(info.value, ImportError)


def test_cli_without_optuna_dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "s.db"
    make_study(f"sqlite:///{db}", study_name="s", instances=("gn6i.xlarge",), counts=(1,), micro_batch_sizes=(4,))
    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)
    assert main(["dashboard", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "lightning_distplan[dashboard]"' in err and len(err.strip().splitlines()) == 1


def test_cli_damaged_sqlite_file_is_one_line_with_hint_and_left_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A study file damaged past its first page still opens and lists its tables: the dashboard would serve pages
    that fail one by one (and write notes into the file). Refused, the file left as it was, and the HINT's
    recovery command gives a file the dashboard serves."""
    import optuna

    db = tmp_path / "study.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
    for i in range(40):
        study.add_trial(optuna.trial.create_trial(params={"x": float(i)}, distributions={"x": optuna.distributions.FloatDistribution(0, 1000)},
                                                  value=float(i), user_attrs={"note": "n" * 800}))
    del study
    assert db.stat().st_size > 3 * 8192
    with open(db, "r+b") as f:
        f.seek(8192)
        f.write(b"\xff" * 4096)
    before = db.read_bytes()
    assert main(["dashboard", f"sqlite:///{db}", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "is damaged (quick_check:" in err and "nothing was served or written" in err and "HINT:" in err, err
    assert len(err.strip().splitlines()) == 1 and db.read_bytes() == before
    hint = err.split("HINT:", 1)[1]
    command = re.search(r"`(sqlite3 .*?)`", hint).group(1)
    if subprocess.run(["sh", "-c", "command -v sqlite3"], capture_output=True).returncode == 0:
        subprocess.run(["sh", "-c", command], cwd=tmp_path, check=True, capture_output=True)
        from lightning_distplan.tuner._dashboard import open_storage

        assert open_storage(f"sqlite:///{tmp_path / 'recovered.db'}").get_all_studies()[0].study_name == "s"


def test_cli_study_file_of_an_older_optuna_schema_names_the_upgrade_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Optuna refuses a file whose schema an older Optuna set up; the HINT said to check the URL and the server. It
    names `optuna storage upgrade` now, with the file's URL."""
    import sqlite3

    db = tmp_path / "study.db"
    make_study(f"sqlite:///{db}", study_name="s", instances=("gn6i.xlarge",), counts=(1,), micro_batch_sizes=(4,))
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("UPDATE alembic_version SET version_num = 'v3.0.0.d'")
        con.execute("UPDATE version_info SET library_version = '3.1.0'")
        con.commit()
    assert main(["dashboard", f"sqlite:///{db}", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "HINT: The study database was set up by an older Optuna than this one" in err
    assert f"`optuna storage upgrade --storage sqlite:///{db}`" in err and "check the database server" not in err, err
