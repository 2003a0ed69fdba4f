"""Snapshots on the wire: deltas between two, and what is never sent (pure, no I/O)."""

from __future__ import annotations

import json
from typing import Any

AGENT_STATES: tuple[str, ...] = ("scheduled", "starting", "running", "frozen", "stopping",
                                 "stopped", "exited", "failed", "backoff", "waiting")
"""Every state an agent row can be in (metrics list each, zero or not)."""

_MISSING = object()
_NOT_DELTA = ("agents", "events", "version")


def snapshot_delta(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What changed from `old` to `new`, in the shape of a `delta` message (without header).

    Agents are keyed by name and carry only changed fields; other top-level keys are sent
    whole when they differ. Events are not part of deltas: they travel as `event` messages.
    """
    out: dict[str, Any] = {}
    old_agents = {a.get("name"): a for a in old.get("agents", [])}
    new_agents = {a.get("name"): a for a in new.get("agents", [])}
    changed: dict[str, Any] = {}
    unset: dict[str, list[str]] = {}
    for name, agent in new_agents.items():
        prev = old_agents.get(name)
        if prev is None:
            changed[name] = agent
            continue
        fields = {k: v for k, v in agent.items() if prev.get(k, _MISSING) != v}
        if fields:
            changed[name] = fields
        gone = [k for k in prev if k not in agent]
        if gone:
            unset[name] = gone
    if changed:
        out["agents"] = changed
    if unset:
        out["agents_unset"] = unset
    removed = [n for n in old_agents if n not in new_agents]
    if removed:
        out["agents_removed"] = removed
    if list(old_agents) != list(new_agents):
        out["agent_order"] = list(new_agents)
    top_set = {k: v for k, v in new.items()
               if k not in _NOT_DELTA and old.get(k, _MISSING) != v}
    top_unset = [k for k in old if k not in _NOT_DELTA and k not in new]
    if top_set:
        out["set"] = top_set
    if top_unset:
        out["unset"] = top_unset
    return out


SECRET_KEYS = ("serve_token",)
"""Top-level keys never served: a `ctl status` reply may carry the token, the web may not."""


def public_view(snap: dict[str, Any]) -> dict[str, Any]:
    if any(k in snap for k in SECRET_KEYS):
        snap = {k: v for k, v in snap.items() if k not in SECRET_KEYS}
    return snap


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)
