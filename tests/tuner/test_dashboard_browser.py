"""optuna-dashboard serves a tuning study and a real headless Chromium renders it.

optuna-dashboard (the server `distplan dashboard` runs) serves a small SQLite study with the
tuner's user attributes on 127.0.0.1 (free port) from a background thread; Debian's Chromium loads the SPA (``--dump-dom`` after the page's
fetches settle under ``--virtual-time-budget``) and we check what the browser actually drew:
the study list, the dashboard's own Pareto-front plot (one plotly point per completed trial),
our attached plots, note and PNG artifacts, and a screenshot.

Skipped only when no Chromium binary exists (CI installs it with .ci/install_chromium.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _synthetic_study import SMALL, make_study  # noqa: E402

pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed (pip install 'lightning_distplan[dashboard]')")

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _chromium() -> str:
    for name in _CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no Chromium found on PATH (tried {', '.join(_CANDIDATES)}); run `bash .ci/install_chromium.sh` (apt-get install chromium chromium-driver)")


def _browser(chromium: str, user_dir: Path, *args: str, timeout: float = 40) -> str:
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={user_dir}",
        # virtual time only advances while the page is idle, so the SPA's API fetches finish first
        "--virtual-time-budget=10000",
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"chromium failed ({out.returncode}): {out.stderr[-2000:]}"
    return out.stdout


def _plot_section(dom: str, element_id: str) -> str:
    """The DOM of one plotly plot, from its container's id to the next plot."""
    start = dom.index(f'id="{element_id}"')
    end = dom.find("js-plotly-plot", start + len(element_id) + 10)
    return dom[start : end if end != -1 else len(dom)]


@pytest.fixture()
def dashboard(tmp_path: Path):
    import optuna

    from lightning_distplan.tuner._dashboard import DashboardServer
    from lightning_distplan.tuner.plots import attach_to_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tmp_path / "distplan.db"
    study = make_study(f"sqlite:///{db}", study_name="bert-on-alicloud-2023", **SMALL)
    attach_to_study(study)  # note + plots + PNG artifacts in tmp_path/distplan-artifacts
    # The same server `distplan dashboard` runs (tests/tuner/test_dashboard_cli.py runs the
    # command itself), here in a background thread of this process to save an interpreter start.
    with DashboardServer(f"sqlite:///{db}", host="127.0.0.1", port=0) as server:
        with urllib.request.urlopen(server.url.replace("/dashboard/", "/api/studies"), timeout=10) as resp:
            assert b"bert-on-alicloud-2023" in resp.read()
        yield server.url, study


def test_dashboard_renders_study_pareto_front_and_attachments(dashboard, tmp_path: Path) -> None:
    chromium = _chromium()
    url, study = dashboard
    user_dir = tmp_path / "chromium-profile"
    n_complete = sum(t.state.name == "COMPLETE" for t in study.trials)
    study_id = study._study_id

    # Studies page: the SPA fetched /api/studies and lists ours.
    home = _browser(chromium, user_dir, "--dump-dom", url)
    assert "bert-on-alicloud-2023" in home

    # Study page: the dashboard draws "Pareto Front" for multi-objective studies (route
    # /dashboard/studies/<id>, component id "graph-pareto-front" in optuna-dashboard 0.21).
    shot = tmp_path / "study.png"
    page = _browser(chromium, user_dir, "--window-size=1600,2400", "--dump-dom", f"--screenshot={shot}", f"{url}studies/{study_id}")
    assert "Pareto Front" in page
    pareto = _plot_section(page, "graph-pareto-front")
    assert 'class="main-svg"' in pareto
    # one plotly marker per completed trial: the browser really drew the study's data
    assert pareto.count('class="point"') == n_complete

    # Our plots attached with save_plotly_graph_object are drawn on the same page.
    ours = _plot_section(page, "user-defined-plot:distplan-pareto-front")
    assert "Cost vs time per step" in ours and ours.count('class="point"') > 0
    breakdown = _plot_section(page, "user-defined-plot:distplan-time-breakdown")
    assert "Time breakdown" in breakdown and 'class="trace bars"' in breakdown

    # PNG artifacts are listed (served from the default <db stem>-artifacts directory).
    assert "Study Artifacts" in page
    assert "bert-on-alicloud-2023-pareto_front.png" in page
    assert "bert-on-alicloud-2023-time_breakdown.png" in page

    # The note page renders our Markdown summary.
    note = _browser(chromium, user_dir, "--dump-dom", f"{url}studies/{study_id}/note")
    assert "Pareto front (cost vs time per step)" in note

    # A screenshot of the study page is a real, non-blank image.
    assert shot.stat().st_size > 50_000
    from PIL import Image

    with Image.open(shot) as img:
        assert img.size == (1600, 2400)
        colors = img.convert("RGB").resize((400, 600)).getcolors(maxcolors=1 << 16)
        assert colors is None or len(colors) > 200  # a blank page has a handful of colours
    if os.environ.get("DISTPLAN_KEEP_SCREENSHOT"):
        shutil.copy(shot, os.environ["DISTPLAN_KEEP_SCREENSHOT"])
