"""deploy/: the systemd unit, the Prometheus scrape configuration and alerts, and the sample
configuration, each checked by the tool that will read it (installed by .ci/run)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from registry.config import Config, load_config, sample_toml
from registry.keys import SigningKey
from tests.api.api_support import with_harness
from tests.conftest import Harness, make_config
from tests.helpers import bearer, sign_in, system_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` with the unit's ExecStart pointed at this installation (it
    checks that the program exists). A directive it cannot parse is only a warning to it, so
    any output fails the test too."""
    unit = (DEPLOY / "registry.service").read_text()
    registry = Path(sys.executable).with_name("registry")
    assert "ExecStart=/opt/registry/.venv/bin/registry serve " in unit
    here = tmp_path / "registry.service"
    here.write_text(unit.replace("/opt/registry/.venv/bin/registry", str(registry)))
    done = _run(system_tool("systemd-analyze", "systemd"), "verify", "--man=no", str(here))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_the_prometheus_configuration_and_alerts_check(tmp_path: Path) -> None:
    promtool = system_tool("promtool", "prometheus")
    done = _run(promtool, "check", "rules", str(DEPLOY / "registry-alerts.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    # The configuration names a token file only a deployment has: point it at one here.
    token = tmp_path / "registry.token"
    token.write_text("token\n")
    config = (DEPLOY / "prometheus.yml").read_text()
    assert "credentials_file: /etc/prometheus/registry.token" in config
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/etc/prometheus/registry.token", str(token))
    )
    shutil.copy(DEPLOY / "registry-alerts.yml", tmp_path)
    done = _run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 17 rules found" in done.stdout


async def test_every_metric_the_alerts_name_is_served(database_url: str, tmp_path: Path) -> None:
    rules = (DEPLOY / "registry-alerts.yml").read_text()
    named = set(re.findall(r"\b(registry_[a-z_]+)", rules))
    assert len(named) >= 10
    admin = SigningKey.generate()
    config = make_config(database_url, tmp_path, auth={"admin_dids": [admin.did]})

    async def body(h: Harness) -> None:
        token = await sign_in(h.client, admin)
        text = (await (await h.client.get("/metrics", headers=bearer(token))).get_data()).decode()
        served = set()
        for family in text_string_to_metric_families(text):
            served.add(family.name)
            served.update(s.name for s in family.samples)
        for kind in ("counter", "histogram"):  # families the text lists with no sample yet
            served.update(re.findall(rf"^# TYPE (\S+) {kind}$", text, re.M))
        # A series only the anchoring leader reports, and only with a backlog, is not in this
        # scrape: it must at least be one the code declares.
        sources = (ROOT / "service" / "metrics.py").read_text()
        sources += (ROOT / "api" / "metrics.py").read_text()
        declared = set(re.findall(r'"(registry_[a-z_]+)"', sources))
        suffixes = ("", "_total", "_count", "_bucket", "_sum")
        missing = {n for n in named if not any(n + s in served for s in suffixes)}
        assert missing <= declared, missing - declared
        # Served only by a process with a read replica (tests/db/test_replica_process.py).
        missing -= {"registry_replica_replayed_sequence", "registry_replica_lag_records"}
        assert len(missing) <= 1, missing  # the rest is served by a node as the test runs it

    await with_harness(config, body)


def test_the_sample_configuration_has_every_key_at_its_default() -> None:
    text = (DEPLOY / "registry.toml").read_text()
    assert text == sample_toml(), "regenerate it: python -m registry.config > deploy/registry.toml"
    assert load_config(DEPLOY / "registry.toml", environ={}) == Config()
    parsed = tomllib.loads(text)
    for section, field in Config.model_fields.items():
        keys = set(field.annotation.model_fields) - {"peers"}  # type: ignore[union-attr]
        assert keys <= set(parsed[section]), section
