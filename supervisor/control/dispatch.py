"""Control requests as plain dicts: one dispatcher for the socket, the UI and the web view.

It sits above the core: the Supervisor never imports it back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fleettop.supervisor.core.freeze import freeze_pid, resume_pid

if TYPE_CHECKING:
    from fleettop.supervisor.core.supervisor import Supervisor



def _pid(req: dict[str, Any]) -> int | None:
    pid = req.get("pid")
    if pid is None:
        return None
    if isinstance(pid, bool) or not isinstance(pid, int | str) or not str(pid).isdigit():
        raise ValueError(f"pid must be a number, got {pid!r}")
    return int(pid)


RELAX_POLICIES = ("warn", "block", "freeze", "kill")


def _relax(sup: Supervisor, name: str, req: dict[str, Any]) -> dict[str, Any] | None:
    """`resume --breaker warn --for 10m`: lower the breaker first, so the resumed agent's
    next loop warns instead of freezing it again at once. An error reply, or None."""
    from fleettop.supervisor.config.units import parse_duration

    policy = str(req["breaker"])
    if policy not in RELAX_POLICIES:
        return {"ok": False, "error": f"breaker must be one of {', '.join(RELAX_POLICIES)}"}
    seconds = parse_duration(str(req.get("for") or "10m"))
    if name not in sup.agents:
        return {"ok": False, "error": f"no agent named {name!r}"}
    if not any(cap.relax_breaker(name, policy, time.time() + seconds)
               for cap in sup.capabilities):
        return {"ok": False, "error": f"{name} has no breaker to lower (not through the proxy)"}
    return None


async def dispatch(sup: Supervisor, req: dict[str, Any]) -> dict[str, Any]:
    cmd = req.get("cmd")
    name = str(req["name"]) if req.get("name") is not None else None
    try:
        if cmd == "status":
            # The web token is for the socket's owner only: never part of the snapshot,
            # which the web view serves to anyone who can read it.
            token = getattr(sup, "serve_token", None)
            return {"ok": True, **sup.snapshot(), **({"serve_token": token} if token else {})}
        if cmd in ("freeze", "resume"):
            pid = _pid(req)
            reason = str(req.get("reason") or f"{cmd} by {req.get('source', 'user')}")
            if pid is not None:
                owner = next((rt for rt in sup.agents.values() if pid in rt.pids()), None)
                if owner is not None and owner.pid == pid:
                    name = owner.name
                else:
                    return (freeze_pid(sup, pid, reason) if cmd == "freeze"
                            else resume_pid(sup, pid, reason))
            if not name:
                return {"ok": False, "error": f"{cmd} needs a name or a pid"}
            if cmd == "freeze":
                return await sup.freeze_agent(name, reason, source=req.get("source", "user"))
            if req.get("breaker"):
                refused = _relax(sup, name, req)
                if refused is not None:
                    return refused
            return await sup.resume_agent(name, reason, source=req.get("source", "user"))
        if cmd in ("restart", "stop", "start", "logs") and not name:
            return {"ok": False, "error": f"{cmd} needs an agent name"}
        if cmd == "restart" and name:
            return await sup.restart_agent(name)
        if cmd == "stop" and name:
            return await sup.stop_agent(name, sig=req.get("signal"))
        if cmd == "start" and name:
            return await sup.start_agent(name)
        if cmd == "logs" and name:
            rt = sup.agents.get(name)
            if rt is None:
                return {"ok": False, "error": f"no agent named {name!r}"}
            n = int(req.get("n", 100))
            lines = rt.log.lines(n) if rt.log else []
            path = str(rt.log.path) if rt.log else None
            return {"ok": True, "name": name, "lines": lines, "path": path}
        if cmd == "events":
            n = int(req.get("n", 100))
            return {"ok": True, "events": [e.to_json() for e in list(sup.events)[-n:]]}
        if cmd == "reload":
            from fleettop.supervisor.config.load import FleetError, load_fleet

            path = sup.fleet.path
            if not path:
                return {"ok": False, "error": "this fleet was not read from a file"}
            try:
                fleet = load_fleet(path)
            except FleetError as exc:  # a bad file changes nothing
                return {"ok": False, "error": f"fleet file not applied:\n{exc}"}
            return await sup.reload(fleet)
        if cmd == "shutdown":
            sup.shutdown_mode = str(req.get("frozen", "stop"))
            sup.shutdown_requested.set()
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {cmd!r}"}
    except KeyError as exc:
        return {"ok": False, "error": str(exc.args[0]) if exc.args else str(exc)}
    except (ValueError, PermissionError, OSError) as exc:
        return {"ok": False, "error": str(exc)}
