"""The fleet file: valid files load; each malformed one gives its message at its position."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fleettop.supervisor.config.load import FleetError, load_fleet, parse_fleet
from fleettop.supervisor.config.units import parse_duration, parse_size, parse_time_of_day
from tests.support.processes import FLEETTOP

ROOT = Path(__file__).resolve().parents[2]

# (fleet text, expected "LINE:COL: field: message" fragment)
MALFORMED = [
    ("agents:\n  a:\n    cmd: [x]\n    restrat: always\n",
     "4:5: agents.a.restrat: unknown key 'restrat' (did you mean 'restart'?)"),
    ("agentz:\n  a: {cmd: x}\n", "1:1: agentz: unknown key 'agentz' (did you mean 'agents'?)"),
    ("agents:\n  a:\n    cwd: /tmp\n", "2:3: agents.a.cmd: missing `cmd`"),
    ("agents:\n  a: {cmd: x, stop_timeout: 10x}\n",
     "2:29: agents.a.stop_timeout: bad duration '10x'"),
    ("agents:\n  a: {cmd: x, stop_timeout: -5}\n",
     "2:29: agents.a.stop_timeout: duration must not be negative"),
    ("agents:\n  a:\n    cmd: x\n    limits: {memory: 12 apples}\n",
     "4:22: agents.a.limits.memory: bad size '12 apples'"),
    ("agents:\n  a:\n    cmd: x\n    limits: {memory: 85%}\n",
     "4:22: agents.a.limits.memory: a percentage is not allowed here"),
    ("agents:\n  a:\n    cmd: x\n    schedule: '* * *'\n",
     "4:15: agents.a.schedule: bad cron expression '* * *'"),
    ("agents:\n  a:\n    cmd: x\n    schedule: '61 * * * *'\n",
     "4:15: agents.a.schedule: bad cron expression '61 * * * *'"),
    ("agents:\n  a: {cmd: x}\n  a: {cmd: y}\n", "3:3: agents.a: duplicate agent name 'a'"),
    ("agents:\n  a:\n    cmd: x\n    depends_on: [b]\n",
     "4:18: agents.a.depends_on[0]: unknown agent 'b'"),
    ("agents:\n  web: {cmd: x}\n  a:\n    cmd: x\n    depends_on: [wbe]\n",
     "5:18: agents.a.depends_on[0]: unknown agent 'wbe' (did you mean 'web'?)"),
    ("agents:\n  a:\n    cmd: x\n    depends_on: [b]\n  b:\n    cmd: y\n    depends_on: [a]\n",
     "4:5: agents.a.depends_on: dependency cycle: a → b → a"),
    ("agents:\n  a:\n    cmd: x\n    depends_on: [a]\n",
     "4:18: agents.a.depends_on[0]: an agent cannot depend on itself"),
    ("agents:\n  a:\n    cmd: x\n    env: {N: 3}\n",
     "4:14: agents.a.env.N: env values are strings"),
    ("agents:\n  a:\n    cmd: x\n    env: {ON: yes}\n",
     "4:15: agents.a.env.ON: env values are strings"),
    ("agents:\n  a:\n    cmd: x\n    restart: sometimes\n",
     "4:14: agents.a.restart: input should be 'no', 'on-failure' or 'always'"),
    ("agents:\n  a:\n    cmd: 42\n", "3:10: agents.a.cmd: cmd is an argv list or a string"),
    ("agents:\n  a:\n    cmd: []\n", "3:10: agents.a.cmd: cmd is empty"),
    ("agents:\n  a:\n    cmd: x\n    priority: high\n",
     "4:15: agents.a.priority: input should be a valid integer"),
    ("agents:\n  a:\n    cmd: x\n    enabled: maybe\n",
     "4:14: agents.a.enabled: input should be a valid boolean"),
    ("agents:\n  a:\n    cmd: [x\n", "4:1: YAML syntax error"),
    ("agents:\n  a:\n    cmd: x\n   bad: y\n", "4:4: YAML syntax error"),
    ("agents:\n  'bad name!': {cmd: x}\n",
     "2:3: agents.bad name!: agent names use letters, digits"),
    ("- just\n- a list\n", "1:1: the fleet file must be a mapping"),
    ("", "1:1: the fleet file is empty"),
    ("version: 2\nagents: {}\n", "1:10: version: input should be 1"),
    ("agents:\n  a:\n    cmd: x\n    backoff: {initial: 1s, factor: 0.5}\n",
     "4:36: agents.a.backoff.factor: input should be greater than or equal to 1"),
    ("agents:\n  a:\n    cmd: x\n    ready: {tcp: '127.0.0.1:80', log: up}\n",
     "4:12: agents.a.ready: give exactly one of tcp, http, log"),
    ("agents:\n  a:\n    cmd: x\n    ready: {tcp: 'localhost'}\n",
     "4:12: agents.a.ready: tcp: expected host:port"),
    ("agents:\n  a:\n    cmd: x\n    health: {tcp: '127.0.0.1:80', http: 'http://h/'}\n",
     "4:13: agents.a.health: give exactly one of tcp, http"),
    ("agents:\n  a:\n    cmd: x\n    health: {http: 'https://h/', interval: soon}\n",
     "agents.a.health.interval"),
    ("agents:\n  a:\n    cmd: x\n    limits: {memroy: 1GiB}\n",
     "4:14: agents.a.limits.memroy: unknown key 'memroy' (did you mean 'memory'?)"),
]


@pytest.mark.parametrize(("text", "expected"), MALFORMED,
                         ids=[f"{i:02d}" for i in range(len(MALFORMED))])
def test_malformed_fleet_reports_message_and_position(text: str, expected: str) -> None:
    with pytest.raises(FleetError) as info:
        parse_fleet(text, "f.yaml")
    lines = [str(p) for p in info.value.problems]
    assert any(line.startswith("f.yaml:") and expected in line for line in lines), lines


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    text = "agents:\n  a:\n    cmd: x\n    restrat: no\n  b:\n    stop_timeout: 1y\n"
    with pytest.raises(FleetError) as info:
        parse_fleet(text, "f.yaml")
    assert len(info.value.problems) == 3  # the typo, the missing cmd, the duration


def test_valid_fleet_loads_with_defaults_and_order() -> None:
    fleet = parse_fleet(
        "agents:\n"
        "  web: {cmd: 'python -m http.server', restart: no, depends_on: [db]}\n"
        "  db:\n    cmd: [sleep, '1']\n    limits: {memory: 512MiB}\n"
        "    env: {A: 'x'}\n    stop_timeout: 1m30s\n    schedule: '*/15 * * * *'\n",
        "ok.yaml")
    web, db = fleet.agents["web"], fleet.agents["db"]
    assert web.restart == "no"  # YAML's bare `no` is the policy, not False
    assert web.argv() == ["python", "-m", "http.server"]
    assert db.limits.memory == 512 * 1024**2 and db.stop_timeout == 90.0
    assert fleet.start_order() == ["db", "web"]
    assert web.restart != "on-failure" and db.restart == "on-failure"


def test_shell_only_when_asked() -> None:
    fleet = parse_fleet("agents:\n  a: {cmd: 'echo $HOME | wc', shell: true}\n"
                        "  b: {cmd: 'echo $HOME | wc'}\n", "s.yaml")
    assert fleet.agents["a"].argv() == ["/bin/sh", "-c", "echo $HOME | wc"]
    assert fleet.agents["b"].argv() == ["echo", "$HOME", "|", "wc"]


def test_units() -> None:
    assert parse_duration("90s") == 90 and parse_duration("15m") == 900
    assert parse_duration("2h") == 7200 and parse_duration("250ms") == 0.25
    assert parse_size("512MiB") == 512 * 1024**2 and parse_size("2GiB") == 2 * 1024**3
    assert parse_size("85%", allow_percent=True) == 85.0
    assert parse_time_of_day("22:00").hour == 22 and parse_time_of_day(1320).hour == 22
    for bad in ("", "10", "5 minutes", "1h-5m"):
        if bad == "10":
            continue
        with pytest.raises(ValueError):
            parse_duration(bad)
    with pytest.raises(ValueError):
        parse_time_of_day("25:00")


def test_check_cli_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("agents:\n  a: {cmd: [sleep, '1']}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("agents:\n  a:\n    cmd: x\n    restrat: always\n")
    ok = subprocess.run([*FLEETTOP, "check", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    fail = subprocess.run([*FLEETTOP, "check", str(bad)], capture_output=True, text=True)
    assert fail.returncode == 2
    assert f"{bad}:4:5: agents.a.restrat: unknown key 'restrat'" in fail.stderr


def test_invalid_fleet_starts_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"agents:\n  a: {{cmd: [touch, '{marker}']}}\n  b: {{cmd: x, oops: 1}}\n")
    run = subprocess.run([*FLEETTOP, "run", "--headless", str(bad), "--for", "2s"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "nothing was started" in run.stderr
    assert not marker.exists()


def test_root_demo_fleet_is_valid() -> None:
    run = subprocess.run([*FLEETTOP, "check", str(ROOT / "fleet.yaml")], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr


HOSTILE = {
    "recursive alias": ("agents: &a\n  x: *a\n", "1:9: ", "recursive alias"),
    "recursive list": ("a: &x [1, *x]\nagents: {}\n", "1:4: ", "recursive alias"),
    "5,000 levels": ("agents:\n  a: {cmd: x, env: " + "[" * 5000 + "]" * 5000 + "}\n",
                     "2:81: ", "nested more than 64 levels deep"),
    "alias bomb": ("a: &a [x, x, x, x, x, x, x, x, x]\n"
                   + "".join(f"{k}: &{k} [{', '.join([f'*{prev}'] * 9)}]\n"
                             for prev, k in zip("abcdef", "bcdefg", strict=True))
                   + "agents: {}\n", "6:4: ", "an alias bomb"),
    "5 MiB": ("agents: {}\n#" + "x" * (5 << 20) + "\n", "1:1: ", "more than 4 MiB is refused"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_yaml_is_refused_with_a_position(name: str) -> None:
    """Limits, not tracebacks: recursive aliases, deep nesting, alias bombs and huge files
    each give one problem with its place (they gave RecursionError, 100% CPU, 1.9 GB)."""
    text, where, message = HOSTILE[name]
    with pytest.raises(FleetError) as info:
        parse_fleet(text, "f.yaml")
    lines = [str(p) for p in info.value.problems]
    assert len(lines) == 1 and lines[0].startswith(f"f.yaml:{where}") and message in lines[0], \
        lines


def test_a_huge_fleet_file_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "fleet.yaml"
    with open(big, "wb") as fh:
        fh.truncate(50 << 20)  # sparse: 50 MB of nothing, never read
    with pytest.raises(FleetError) as info:
        load_fleet(big)
    assert "50 MiB: more than 4 MiB is refused" in str(info.value)


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    """`fleettop ctl status --json | head`: the pipe closes under the writer (it printed a
    BrokenPipeError traceback)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("agents:\n  a: {cmd: [sleep, '1']}\n")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        run = subprocess.run([*FLEETTOP, "check", str(fleet)], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr, run.stderr
    assert run.returncode == 141


def test_version() -> None:
    run = subprocess.run([*FLEETTOP, "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.startswith("fleettop "), run.stdout + run.stderr


def test_check_names_what_cannot_start_on_this_host(tmp_path: Path) -> None:
    """`check` said ok for these: a missing cwd, an unknown user and a state dir that cannot
    be made are errors with their place; a program not on PATH is a warning (the host that
    runs the agent may have it)."""
    fleet = tmp_path / "fleet.yaml"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fleet.write_text(f"state_dir: {blocker}/state\n"
                     "agents:\n"
                     "  a:\n"
                     "    cmd: [no-such-program-here]\n"
                     "    cwd: /no/such/folder\n"
                     "    user: no-such-user-here\n"
                     "  b: {cmd: [sleep, '1']}\n")
    run = subprocess.run([*FLEETTOP, "check", str(fleet)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    err = run.stderr
    assert f"{fleet}:5:10: agents.a.cwd: no folder '/no/such/folder'" in err, err
    assert f"{fleet}:6:11: agents.a.user: no user 'no-such-user-here'" in err, err
    assert f"{fleet}:1:12: state_dir: cannot make" in err, err
    assert f"{fleet}:4:10: agents.a.cmd: 'no-such-program-here' is not on this host's PATH" \
        in err and "(warning)" in err, err
    fleet.write_text("agents:\n  a: {cmd: [no-such-program-here]}\n")
    run = subprocess.run([*FLEETTOP, "check", str(fleet)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and "1 warning" in run.stdout, run.stdout + run.stderr
