"""`fleettop doctor` on this machine, with checks forced to fail, and on fleet files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fleettop.supervisor.cli import doctor

NAMES = {"root", "tracefs", "btf", "kprobes", "bcc", "headers", "lockdown", "bpf_load",
         "cgroup", "psi", "nvml", "fleet", "ports", "proxy_ca", "proxy_relay", "terminal"}


def doctor_json(*argv: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "fleettop.supervisor.cli.doctor", "doctor",
                           "--json", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    return proc.returncode, json.loads(proc.stdout)


def test_doctor_on_this_machine_names_every_check_with_a_verdict():
    rc, out = doctor_json()
    checks = {c["name"]: c for c in out["checks"]}
    assert set(checks) == NAMES
    assert all(c["status"] in ("ok", "warn", "fail") for c in checks.values())
    assert all(c["fix"] for c in checks.values() if c["status"] != "ok")
    assert rc == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)
    assert out["ok"] == (rc == 0)
    # whatever this machine is, the eBPF verdict agrees with the probe's own precheck
    from fleettop.probes.sensors.source import ebpf_precheck
    if ebpf_precheck() is None:
        assert checks["bpf_load"]["status"] == "ok", checks["bpf_load"]


def test_forced_failures_exit_nonzero_with_a_fix():
    rc, out = doctor_json("--no-trial", env={"FLEETTOP_DOCTOR_FAIL": "btf,cgroup"})
    assert rc == 1 and out["ok"] is False
    failed = {c["name"]: c for c in out["checks"] if c["status"] == "fail"}
    assert set(failed) >= {"btf", "cgroup"}
    assert all(c["fix"] for c in failed.values())


def test_a_broken_check_is_reported_not_raised(monkeypatch, capsys):
    def boom(_):
        raise RuntimeError("kaput")

    monkeypatch.setattr(doctor, "CHECKS", [boom, doctor.check_psi])
    assert doctor.main(["doctor", "--no-trial"]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "kaput" in text


def test_fleet_file_is_validated(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents:\n  a:\n    cmdd: x\n")
    rc, out = doctor_json("--no-trial", "-f", str(bad))
    fleet = next(c for c in out["checks"] if c["name"] == "fleet")
    assert rc == 1 and fleet["status"] == "fail" and "bad.yaml" in fleet["detail"]
    good = tmp_path / "good.yaml"
    good.write_text("agents:\n  a:\n    cmd: sleep 1\n")
    _, out = doctor_json("--no-trial", str(good))
    fleet = next(c for c in out["checks"] if c["name"] == "fleet")
    assert fleet["status"] == "ok" and "1 agents" in fleet["detail"]


def test_proxy_ca_key_must_be_private(tmp_path: Path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("agents: {}\n")
    state = tmp_path / "state"
    env = {"FLEETTOP_STATE_DIR": str(state)}
    rc, out = doctor_json("--no-trial", str(fleet), env=env)
    check = next(c for c in out["checks"] if c["name"] == "proxy_ca")
    assert check["status"] == "ok" and "made at the first start" in check["detail"]
    from fleettop.supervisor.base import paths

    os.environ["FLEETTOP_STATE_DIR"] = str(state)
    confdir = paths.state_dir(str(fleet)) / "proxy/mitmproxy"
    confdir.mkdir(parents=True)
    (confdir / "mitmproxy-ca.pem").write_text("key")
    (confdir / "mitmproxy-ca.pem").chmod(0o644)
    rc, out = doctor_json("--no-trial", str(fleet), env=env)
    check = next(c for c in out["checks"] if c["name"] == "proxy_ca")
    assert rc == 1 and check["status"] == "fail" and "chmod 600" in check["fix"]


def test_proxy_relay_says_what_is_missing(monkeypatch):
    from importlib import metadata

    real = metadata.version
    assert doctor.check_proxy_relay(None).status == "ok"  # this venv: pinned mitmproxy, uvloop

    def without(missing: str, mitm: str = "11.0.2"):
        def version(name: str) -> str:
            if name == missing:
                raise metadata.PackageNotFoundError(name)
            return mitm if name == "mitmproxy" else real(name)
        return version

    monkeypatch.setattr(metadata, "version", without("uvloop"))
    c = doctor.check_proxy_relay(None)
    assert (c.status, c.fix) == ("warn", "pip install uvloop")
    monkeypatch.setattr(metadata, "version", without("none", mitm="12.0.0"))
    c = doctor.check_proxy_relay(None)
    assert c.status == "warn" and "chunk by chunk" in c.detail and "11.0.2" in c.fix
    monkeypatch.setattr(metadata, "version", without("mitmproxy"))
    assert doctor.check_proxy_relay(None).status == "fail"
