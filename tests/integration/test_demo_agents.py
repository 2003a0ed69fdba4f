"""Each demo agent, run as a real process against the mock LLM, briefly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture(scope="module")
def mock() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleettop.supervisor.demo.mock_llm", "--port", "0",
         "--token-delay", "0", "--slow-delay", "0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith("mock-llm listening on http://127.0.0.1:"), line
    yield line.rsplit(" ", 1)[1]
    proc.terminate()
    proc.wait(timeout=5)


def stats(mock: str) -> dict[str, Any]:
    with _OPENER.open(mock + "/mock/stats", timeout=5) as resp:
        out: dict[str, Any] = json.load(resp)
        return out


def reset(mock: str) -> None:
    _OPENER.open(urllib.request.Request(mock + "/mock/reset", data=b"{}"), timeout=5).close()


def agent_env(llm: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() not in _PROXY_VARS}
    return env | {"FLEETTOP_DEMO_LLM": llm} | extra


def agent_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleettop.supervisor.demo.agents", *args]


def run_agent(mock: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(agent_cmd(*args), env=agent_env(mock, **env), capture_output=True,
                          text=True, timeout=20)


def test_chat_turns_then_loops(mock: str) -> None:
    reset(mock)
    out = run_agent(mock, "chat", "--turns", "3", "--interval", "0", "--loop-after", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split()[3] for ln in lines] == ["demo-chat:", "demo-chat:", "demo-loop:"]
    assert all(ln.startswith("[chat] turn ") and "tokens]" in ln for ln in lines)
    assert stats(mock)["requests"] == {"demo-chat": 2, "demo-loop": 1}


def test_a_demo_agent_has_a_name_of_its_own(mock: str) -> None:
    """Their process was `fleettop`: `probe.child_exit looper: fleettop exited` read as if
    fleettop itself had died."""
    proc = subprocess.Popen(agent_cmd("chat", "--interval", "5"), env=agent_env(mock),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        comm = Path(f"/proc/{proc.pid}/comm")
        deadline = time.monotonic() + 20
        while comm.read_text().strip() != "demo-chat":
            assert time.monotonic() < deadline, comm.read_text()
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_chat_goes_through_http_proxy(mock: str) -> None:
    """urllib's default opener must honour HTTP_PROXY even for loopback.

    The base URL points at a closed port; the mock (which, like aiohttp, accepts the
    absolute-form request line a proxy gets) stands in for the proxy. Only a request that
    went through HTTP_PROXY can succeed.
    """
    reset(mock)
    out = run_agent(mock, "chat", "--turns", "1", "--interval", "0",
                    FLEETTOP_DEMO_LLM="http://127.0.0.1:9", HTTP_PROXY=mock, http_proxy=mock)
    assert out.returncode == 0 and "tokens]" in out.stdout, out.stdout
    assert stats(mock)["requests"] == {"demo-chat": 1}


def test_openai_style_base_url_and_model_override(mock: str) -> None:
    """A vLLM/OpenAI base ending in /v1 and FLEETTOP_DEMO_MODEL point the demo elsewhere."""
    reset(mock)
    out = run_agent(mock, "chat", "--turns", "1", "--interval", "0",
                    FLEETTOP_DEMO_LLM=mock + "/v1", FLEETTOP_DEMO_MODEL="demo-json",
                    FLEETTOP_DEMO_API_KEY="sk-test")
    assert out.returncode == 0 and "demo-json:" in out.stdout, out.stdout
    assert stats(mock)["requests"] == {"demo-json": 1}


def test_retry_loop_hammers_the_failing_model(mock: str) -> None:
    reset(mock)
    out = run_agent(mock, "retry-loop", "--ok-turns", "2", "--turns", "6", "--delay", "0")
    assert out.returncode == 1
    attempts = [ln for ln in out.stdout.splitlines() if "attempt" in ln]
    assert len(attempts) == 4 and all("HTTP 500" in a for a in attempts)
    assert stats(mock)["requests"] == {"demo-chat": 2, "demo-error": 4}


def test_leaky_grows_to_its_cap(mock: str) -> None:
    out = run_agent(mock, "leaky", "--turns", "4", "--interval", "0.2", "--rate", "200",
                    "--max", "24")
    assert out.returncode == 0, out.stderr
    held = [float(ln.split("held=")[1].split()[0]) for ln in out.stdout.splitlines()]
    rss = [float(ln.split("rss=")[1].split()[0]) for ln in out.stdout.splitlines()]
    assert held[0] == 0 and held[-1] == 24 and held == sorted(held)
    assert rss[-1] - rss[0] >= 20


def test_batch_is_one_shot(mock: str) -> None:
    out = run_agent(mock, "batch", "--calls", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].startswith("[batch] done: 2 calls")


def test_batch_fails_without_backend() -> None:
    out = run_agent("http://127.0.0.1:9", "batch")
    assert out.returncode == 1 and "failed" in out.stdout


def test_spin_stops_at_its_limit() -> None:
    out = run_agent("http://127.0.0.1:9", "spin", "--seconds", "0.3")
    assert out.returncode == 0 and "stopped after" in out.stdout


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()]


def test_sleeper_tree_and_sigterm() -> None:
    proc = subprocess.Popen(agent_cmd("sleeper", "--children", "2"),
                            env=agent_env("http://127.0.0.1:9"), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    assert "sleeping with children" in proc.stdout.readline()
    kids = _children(proc.pid)
    assert len(kids) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 128 + signal.SIGTERM
    for kid in kids:  # reaped by the parent, so gone for good
        assert not Path(f"/proc/{kid}").exists()


def test_chat_exits_promptly_on_sigterm(mock: str) -> None:
    proc = subprocess.Popen(agent_cmd("chat", "--interval", "30"), env=agent_env(mock),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("[chat] turn 1")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == -signal.SIGTERM


def test_main_returns_exit_code(mock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleettop.supervisor.demo import agents

    monkeypatch.setenv("FLEETTOP_DEMO_LLM", mock)
    for var in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert agents.main(["batch", "--calls", "1"]) == 0
    assert agents.main(["spin", "--seconds", "0.05"]) == 0
