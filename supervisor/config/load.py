"""The fleet file: YAML with positions → validated pydantic models.

`load_fleet(path)` returns a `Fleet` or raises `FleetError` whose problems each carry
`FILE:LINE:COL: path.to.field: message`. The YAML is composed into nodes first so every value
keeps its position; pydantic validates the shape; cross-agent rules (depends_on, cycles) run
after. Nothing starts unless all of it passes.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from fleettop.supervisor.config.fleet import AGENT_NAME, AgentSpec, Fleet
from fleettop.supervisor.config.gpu import (
    check_routes,
)


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    col: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}"
        field = f"{self.field}: " if self.field else ""
        return f"{where}: {field}{self.message}"


class FleetError(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


Marks = dict[tuple[str | int, ...], tuple[int, int]]


MAX_FILE_BYTES = 4 << 20
"""A fleet of a thousand agents is ~200 KiB; past this the file is refused unread."""
MAX_DEPTH = 64
"""Nesting of mappings and lists; the real schema goes 5 deep."""
MAX_VALUES = 200_000
"""Values built from the file, aliases expanded: an alias bomb stops here, not at 2 GB."""


class _Hostile(Exception):
    """The file is past a limit: reported as one problem at this node."""

    def __init__(self, node: yaml.Node | yaml.Event | yaml.Mark, message: str) -> None:
        mark = node if isinstance(node, yaml.Mark) else node.start_mark
        super().__init__(message)
        self.line: int = mark.line + 1 if mark else 1
        self.col: int = mark.column + 1 if mark else 1


def _check_shape(text: str) -> None:
    """Depth first, from the event stream (no recursion): PyYAML's composer recurses once
    per level and would die of a RecursionError on a deep file."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Hostile(event, f"nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


class _Composer:
    """Turns YAML nodes into plain data and remembers where each key and value sits."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.marks: Marks = {}
        self.key_marks: Marks = {}
        self.problems: list[Problem] = []

    def measure(self, root: yaml.Node) -> None:
        """Count the values the file expands to, each node's once (aliases share nodes), and
        find an alias that refers to a value containing it, before building anything."""
        sizes: dict[int, int] = {}
        open_: set[int] = set()

        def size(node: yaml.Node) -> int:
            key = id(node)
            if key in sizes:
                return sizes[key]
            if key in open_:
                raise _Hostile(node, "an alias refers to a value that contains it "
                                     "(a recursive alias)")
            n = 1
            if isinstance(node, yaml.CollectionNode):
                open_.add(key)
                items = node.value if isinstance(node, yaml.SequenceNode) else [
                    part for pair in node.value for part in pair]
                n += sum(size(item) for item in items)
                open_.discard(key)
            if n > MAX_VALUES:
                raise _Hostile(node, f"more than {MAX_VALUES} values once aliases are "
                                     "expanded (an alias bomb?)")
            sizes[key] = n
            return n

        size(root)

    def build(self, node: yaml.Node, path: tuple[str | int, ...]) -> Any:
        self.marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                # Keys stay as written: an env var named ON or NO is not a boolean.
                key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else str(
                    self.build(key_node, (*path, "<key>")))
                kpath = (*path, key)
                if key in out:
                    line, col = key_node.start_mark.line + 1, key_node.start_mark.column + 1
                    what = "agent name" if path == ("agents",) else "key"
                    self.problems.append(Problem(self.file, line, col, _dotted(kpath),
                                                 f"duplicate {what} {key!r}"))
                    continue
                self.key_marks[kpath] = (key_node.start_mark.line + 1,
                                         key_node.start_mark.column + 1)
                out[key] = self.build(value_node, kpath)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, (*path, i)) for i, item in enumerate(node.value)]
        return yaml.SafeLoader(yaml.serialize(node)).get_single_data() if node.tag else node.value


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _did_you_mean(model: type[BaseModel] | None, key: str) -> str:
    if model is None:
        return ""
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _model_at(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at `path` (for did-you-mean)."""
    model: Any = Fleet
    i = 0
    while i < len(path):
        part = path[i]
        if model is Fleet and part == "agents":
            if i + 1 >= len(path):
                return None
            model, i = AgentSpec, i + 2
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        candidates = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)]
        nxt = next((a for a in candidates if issubclass(a, BaseModel)), None)
        if nxt is None:
            return None
        model, i = nxt, i + 1
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _position(c: _Composer, loc: tuple[str | int, ...], key: bool) -> tuple[int, int]:
    table = c.key_marks if key else c.marks
    for n in range(len(loc), -1, -1):
        if loc[:n] in table:
            return table[loc[:n]]
        if loc[:n] in c.marks:
            return c.marks[loc[:n]]
    return (1, 1)


def _clean_loc(loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    # pydantic adds union branch names ("list[str]", "str", "function-before[...]").
    noise = ("str", "int", "float", "bool")
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in p and p not in noise))


def _message(err: Any) -> str:
    msg = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if err["type"] == "missing":
        return "required field is missing"
    return msg[0].lower() + msg[1:] if msg else msg


def parse_fleet(text: str, file: str = "fleet.yaml") -> Fleet:
    return parse_fleet_marked(text, file)[0]


def parse_fleet_marked(text: str, file: str = "fleet.yaml") -> tuple[Fleet, Marks]:
    """The fleet and where each value sits (for problems found after loading)."""
    c = _Composer(file)
    if len(text) > MAX_FILE_BYTES:
        raise FleetError([Problem(file, 1, 1, "", f"the fleet file is {len(text) >> 20} MiB: "
                                  f"more than {MAX_FILE_BYTES >> 20} MiB is refused")])
    try:
        _check_shape(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = exc.problem or str(exc)
        context = f" ({exc.context})" if exc.context else ""
        msg = f"YAML syntax error: {problem}{context}"
        raise FleetError([Problem(file, line, col, "", msg)]) from None
    except yaml.YAMLError as exc:
        raise FleetError([Problem(file, 1, 1, "", f"YAML error: {exc}")]) from None
    except _Hostile as exc:
        raise FleetError([Problem(file, exc.line, exc.col, "", str(exc))]) from None
    if root is None:
        raise FleetError([Problem(file, 1, 1, "", "the fleet file is empty: it needs `agents:`")])
    if not isinstance(root, yaml.MappingNode):
        line, col = root.start_mark.line + 1, root.start_mark.column + 1
        raise FleetError([Problem(file, line, col, "", "the fleet file must be a mapping")])
    try:
        c.measure(root)
        data = c.build(root, ())
    except _Hostile as exc:
        raise FleetError([Problem(file, exc.line, exc.col, "", str(exc))]) from None
    problems = list(c.problems)

    agents = data.get("agents")
    if isinstance(agents, dict):
        for name, spec in agents.items():
            if not AGENT_NAME.match(name):
                line, col = c.key_marks.get(("agents", name), (1, 1))
                problems.append(Problem(file, line, col, f"agents.{name}",
                                        "agent names use letters, digits, '-', '_', '.'"))
            if isinstance(spec, dict):
                spec["name"] = name

    fleet: Fleet | None = None
    try:
        fleet = Fleet.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc = _clean_loc(err["loc"])
            is_extra = err["type"] == "extra_forbidden"
            if err["type"] == "missing":
                line, col = _position(c, loc[:-1], key=True)  # the mapping that lacks it
            else:
                line, col = _position(c, loc, key=is_extra)
            msg = _message(err)
            if len(loc) >= 2 and loc[-2] == "env" and err["type"] == "string_type":
                msg = f"env values are strings: quote it ({_dotted(loc)}: \"...\")"
            if loc and loc[-1] == "cmd" and err["type"] in ("string_type", "list_type"):
                msg = "cmd is an argv list or a string"
            if is_extra:
                msg = f"unknown key {loc[-1]!r}{_did_you_mean(_model_at(loc[:-1]), str(loc[-1]))}"
            if loc and loc[-1] == "cmd" and err["type"] == "missing":
                msg = "missing `cmd`: the command to run (a list, or a string)"
            problems.append(Problem(file, line, col, _dotted(loc), msg))

    if isinstance(agents, dict):
        problems += _dependency_problems(agents, c, file)
    if fleet is not None:
        for message in check_routes(fleet.models, fleet.routes):
            line, col = c.key_marks.get(("routes",), (1, 1))
            problems.append(Problem(file, line, col, "routes", message))
    if problems:
        problems.sort(key=lambda p: (p.line, p.col))
        raise FleetError(_dedupe(problems))
    assert fleet is not None
    return fleet.model_copy(update={"path": file}), c.marks


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for p in problems:
        if str(p) not in seen:
            seen.add(str(p))
            out.append(p)
    return out


def _dependency_problems(agents: dict[str, Any], c: _Composer, file: str) -> list[Problem]:
    problems: list[Problem] = []
    graph: dict[str, list[str]] = {}
    for name, spec in agents.items():
        deps = spec.get("depends_on", []) if isinstance(spec, dict) else []
        if not isinstance(deps, list):
            continue
        graph[name] = []
        for i, dep in enumerate(deps):
            if not isinstance(dep, str):
                continue
            if dep not in agents:
                line, col = c.marks.get(("agents", name, "depends_on", i), (1, 1))
                close = difflib.get_close_matches(dep, list(agents), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(Problem(file, line, col, f"agents.{name}.depends_on[{i}]",
                                        f"unknown agent {dep!r}{hint}"))
            elif dep == name:
                line, col = c.marks.get(("agents", name, "depends_on", i), (1, 1))
                problems.append(Problem(file, line, col, f"agents.{name}.depends_on[{i}]",
                                        "an agent cannot depend on itself"))
            else:
                graph[name].append(dep)
    cycle = _find_cycle(graph)
    if cycle:
        first = cycle[0]
        line, col = c.key_marks.get(("agents", first, "depends_on"), (1, 1))
        problems.append(Problem(file, line, col, f"agents.{first}.depends_on",
                                "dependency cycle: " + " → ".join([*cycle, first])))
    return problems


def _find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = grey
        stack.append(node)
        for nxt in graph.get(node, []):
            if color.get(nxt) == grey:
                return stack[stack.index(nxt):]
            if color.get(nxt) == white:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = black
        return None

    for node in graph:
        if color[node] == white:
            found = visit(node)
            if found:
                return found
    return None


def load_fleet(path: str | os.PathLike[str]) -> Fleet:
    return load_fleet_marked(path)[0]


def load_fleet_marked(path: str | os.PathLike[str]) -> tuple[Fleet, Marks]:
    file = str(path)
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:  # refused unread: a 50 MB file once took minutes and GBs
            raise FleetError([Problem(file, 1, 1, "", f"the fleet file is {size >> 20} MiB: "
                                      f"more than {MAX_FILE_BYTES >> 20} MiB is refused")])
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FleetError([Problem(file, 1, 1, "", "no such file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FleetError([Problem(file, 1, 1, "", f"cannot read: {exc}")]) from None
    return parse_fleet_marked(text, file)
