"""A real browser for the report tests: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by Selenium.

The ``browser`` fixture installs the two packages when they are missing (as root, with apt, the
way the Slurm fixture installs Slurm; once per test process, under a lock) and skips with the
reason where they cannot be installed. :func:`open_report` loads a page from a ``file://`` URL
and returns what the tests check: console messages, every URL the page requested (from
Chromium's performance log), the charts the page declares and those Plotly rendered, the page
text, and each chart's data (read from the live page, ``element.data``).
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
LOCK = Path("/tmp/trainwright_browser_install.lock")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1600")
"""Chromium's flags: headless, and none of its own background connections (this machine's
network is closed; they would be refused, many at a time)."""


@functools.cache
def _install() -> str:
    """'' when Chromium and its driver are here (installing them if needed), else why not."""
    if Path(CHROMIUM).exists() and Path(DRIVER).exists():
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Chromium is not installed and this user cannot apt-get install it"
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
            proc = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends",
                                   "chromium", "chromium-driver"], env=env, capture_output=True,
                                  text=True, timeout=900)
            if proc.returncode != 0:
                return f"apt-get install chromium chromium-driver failed: {proc.stderr[-500:]}"
    return ""


@dataclass
class PageCheck:
    console: list
    """Console messages: dicts with level and message."""
    requests: list
    """Every URL the page asked for (the document itself included)."""
    declared_charts: int
    rendered_charts: int
    """Plotly charts with their SVG drawn."""
    text: str
    data: dict
    """Chart id -> its traces (name, x, y, hovertext)."""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium under Selenium (module-wide), or a skip saying why there is none."""
    problem = _install()
    if problem:
        pytest.skip(problem)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=DRIVER))
    yield driver
    driver.quit()


_TRACES = """
return Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => [el.id,
  (el.data || []).map(t => ({name: t.name === undefined ? null : t.name,
    x: t.x ? Array.from(t.x) : [], y: t.y ? Array.from(t.y) : [],
    hovertext: t.hovertext ? Array.from(t.hovertext) : []}))]);
"""


def open_report(driver, path: Path, timeout: float = 60.0) -> PageCheck:
    """Load ``path`` and wait until every declared chart is drawn (or ``timeout``)."""
    driver.get_log("performance")  # drop what earlier pages logged
    driver.get_log("browser")
    uri = Path(path).resolve().as_uri()
    driver.get(uri)
    declared = json.loads(driver.execute_script(
        "return document.getElementById('report-meta').textContent"))["charts"]
    deadline, rendered = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        rendered = driver.execute_script(
            "return Array.from(document.querySelectorAll('.js-plotly-plot'))"
            ".filter(el => el.querySelector('.main-svg')).length")
        if rendered >= declared:
            break
        time.sleep(0.2)
    requests = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message.get("method") == "Network.requestWillBeSent" \
                and params.get("documentURL") == uri:  # not the browser's own start page
            requests.append(params["request"]["url"])
    return PageCheck(console=driver.get_log("browser"), requests=requests,
                     declared_charts=declared, rendered_charts=rendered,
                     text=driver.find_element("tag name", "body").text,
                     data={cid: traces for cid, traces in driver.execute_script(_TRACES)})


def assert_self_contained(check: PageCheck) -> None:
    """No console error, no request outside file:/data:, every declared chart drawn."""
    errors = [m for m in check.console if m.get("level") == "SEVERE"]
    assert not errors, errors
    outside = [u for u in check.requests if not u.startswith(("file:", "data:"))]
    assert not outside, outside
    assert check.declared_charts > 0 and check.rendered_charts == check.declared_charts, \
        (check.declared_charts, check.rendered_charts)
