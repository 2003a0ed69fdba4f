"""The mock LLM's wire formats: one scripted `Plan` framed as OpenAI (chat, completions,
responses), Anthropic or Ollama, streamed or whole, and each API's error shapes."""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from fleettop.supervisor.demo import scripts

Frame = tuple[bytes, bool]
"""One chunk to write, and whether it carries a text delta (the stream sleeps after those)."""
DEFAULT_KEEP_ALIVE = 300.0
FOREVER = float("inf")


@dataclass
class Plan:
    """One scripted generation, ready to be framed in any wire format."""

    model: str
    prompt_tokens: int
    deltas: list[str]
    truncated: bool
    delay: float
    cold: bool = False

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def completion_tokens(self) -> int:
        return sum(scripts.estimate_tokens(d) for d in self.deltas)


# ---------------------------------------------------------------- request helpers


def base_model(model: str) -> str:
    return model.removesuffix(":latest")


def _text_of(value: Any) -> str:
    """Flatten message content (str, or a list of typed parts) into plain text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text_of(v) for v in value)
    if isinstance(value, dict):
        if "content" in value:
            return _text_of(value["content"])
        return str(value.get("text", ""))
    return ""


def prompt_text(body: dict[str, Any]) -> str:
    """All the text a request sends to the model, for prompt-token estimates and seeding."""
    parts = [_text_of(body.get(k)) for k in ("system", "instructions", "prompt", "input")]
    parts.append(_text_of(body.get("messages", [])))
    return "\n".join(p for p in parts if p)


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m"); <0 = forever."""
    if value is None:
        return DEFAULT_KEEP_ALIVE
    if isinstance(value, int | float):
        return FOREVER if value < 0 else float(value)
    text = str(value).strip()
    with contextlib.suppress(ValueError):
        return parse_keep_alive(float(text))
    if text.startswith("-"):
        return FOREVER
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return DEFAULT_KEEP_ALIVE
    return sum(float(n) * _UNIT[u] for n, u in parts)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def local_iso(epoch: float) -> str:
    if epoch == FOREVER:
        return (datetime.now().astimezone() + timedelta(days=365 * 290)).isoformat()
    return datetime.fromtimestamp(epoch).astimezone().isoformat()


def json_response(data: Any, status: int = 200) -> web.Response:
    # Compact like the real servers; aiohttp's default dumps adds spaces.
    return web.json_response(data, status=status, dumps=_compact)


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def _sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()


def _ndjson(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, separators=(",", ":")) + "\n").encode()


# ---------------------------------------------------------------- error shapes


def _openai_error(status: int, message: str, type_: str, code: str | None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return json_response(body, status=status)


def _anthropic_error(status: int, type_: str, message: str) -> web.Response:
    body = {"type": "error", "error": {"type": type_, "message": message}}
    return json_response(body, status=status)


def _ollama_error(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status=status)


def not_found(api: str, model: str) -> web.Response:
    if api == "anthropic":
        return _anthropic_error(404, "not_found_error", f"model: {model}")
    if api == "ollama":
        return _ollama_error(404, f'model "{model}" not found, try pulling it first')
    msg = f"The model `{model}` does not exist or you do not have access to it."
    return _openai_error(404, msg, "invalid_request_error", "model_not_found")


def server_error(api: str) -> web.Response:
    if api == "anthropic":
        return _anthropic_error(500, "api_error", "Internal server error")
    if api == "ollama":
        return _ollama_error(500, "llama runner process has terminated: exit status 2")
    msg = "The server had an error while processing your request. Sorry about that!"
    return _openai_error(500, msg, "server_error", None)


def bad_request(api: str, message: str) -> web.Response:
    if api == "anthropic":
        return _anthropic_error(400, "invalid_request_error", message)
    if api == "ollama":
        return _ollama_error(400, message)
    return _openai_error(400, message, "invalid_request_error", None)


# ---------------------------------------------------------------- wire formats


def _chat_chunk(plan: Plan, cid: str, created: int, delta: dict[str, Any],
                finish: str | None, usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": plan.model,
        "system_fingerprint": "fp_mock",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = None
    return chunk


def _openai_usage(plan: Plan) -> dict[str, int]:
    return {"prompt_tokens": plan.prompt_tokens, "completion_tokens": plan.completion_tokens,
            "total_tokens": plan.prompt_tokens + plan.completion_tokens}


def openai_chat_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    first = {"role": "assistant", "content": "", "refusal": None}
    yield _sse(_chat_chunk(plan, cid, created, first, None, usage)), False
    for d in plan.deltas:
        yield _sse(_chat_chunk(plan, cid, created, {"content": d}, None, usage)), True
    finish = "length" if plan.truncated else "stop"
    yield _sse(_chat_chunk(plan, cid, created, {}, finish, usage)), False
    if usage:
        last = _chat_chunk(plan, cid, created, {}, None, False)
        last["choices"], last["usage"] = [], _openai_usage(plan)
        yield _sse(last), False
    yield _sse("[DONE]"), False


def openai_chat_json(plan: Plan) -> dict[str, Any]:
    message = {"role": "assistant", "content": plan.text, "refusal": None}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
        "created": int(time.time()), "model": plan.model, "system_fingerprint": "fp_mock",
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "length" if plan.truncated else "stop"}],
        "usage": _openai_usage(plan),
    }


def _completion(plan: Plan, cid: str, created: int, text: str, finish: str | None
                ) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": plan.model,
            "system_fingerprint": "fp_mock",
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}


def openai_completion_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    for d in plan.deltas:
        yield _sse(_completion(plan, cid, created, d, None)), True
    yield _sse(_completion(plan, cid, created, "", "length" if plan.truncated else "stop")), False
    if usage:
        last = _completion(plan, cid, created, "", None)
        last["choices"], last["usage"] = [], _openai_usage(plan)
        yield _sse(last), False
    yield _sse("[DONE]"), False


def openai_completion_json(plan: Plan) -> dict[str, Any]:
    out = _completion(plan, f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), plan.text,
                      "length" if plan.truncated else "stop")
    out["usage"] = _openai_usage(plan)
    return out


def _response_obj(plan: Plan, rid: str, created: int, body: dict[str, Any], status: str,
                  output: list[dict[str, Any]], usage: bool) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": None, "incomplete_details": incomplete,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "model": plan.model,
        "output": output, "parallel_tool_calls": True, "previous_response_id": None,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "tool_choice": "auto", "tools": [], "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": plan.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": plan.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": plan.prompt_tokens + plan.completion_tokens,
        } if usage else None,
    }


def _response_item(mid: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [part] if status == "completed" or text else []}


def responses_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    rid, mid, created = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}", int(time.time())
    seq = iter(range(1 << 30))

    def ev(kind: str, **data: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **data}, event=kind)

    yield ev("response.created",
             response=_response_obj(plan, rid, created, body, "in_progress", [], False)), False
    yield ev("response.in_progress",
             response=_response_obj(plan, rid, created, body, "in_progress", [], False)), False
    yield ev("response.output_item.added", output_index=0,
             item=_response_item(mid, "", "in_progress")), False
    loc = {"item_id": mid, "output_index": 0, "content_index": 0}
    yield ev("response.content_part.added", **loc,
             part={"type": "output_text", "text": "", "annotations": []}), False
    for d in plan.deltas:
        yield ev("response.output_text.delta", **loc, delta=d, logprobs=[]), True
    text = plan.text
    yield ev("response.output_text.done", **loc, text=text, logprobs=[]), False
    yield ev("response.content_part.done", **loc,
             part={"type": "output_text", "text": text, "annotations": []}), False
    item = _response_item(mid, text, "incomplete" if plan.truncated else "completed")
    yield ev("response.output_item.done", output_index=0, item=item), False
    status = "incomplete" if plan.truncated else "completed"
    final = _response_obj(plan, rid, created, body, status, [item], True)
    yield ev(f"response.{status}", response=final), False


def responses_json(plan: Plan, body: dict[str, Any]) -> dict[str, Any]:
    status = "incomplete" if plan.truncated else "completed"
    item = _response_item(f"msg_{uuid.uuid4().hex}", plan.text, status)
    out = _response_obj(plan, f"resp_{uuid.uuid4().hex}", int(time.time()), body, status,
                        [item], True)
    out["output_text"] = plan.text
    return out


def _anthropic_stop(plan: Plan) -> str:
    return "max_tokens" if plan.truncated else "end_turn"


def anthropic_frames(plan: Plan, body: dict[str, Any]) -> Iterator[Frame]:
    message: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
        "model": plan.model, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": plan.prompt_tokens, "output_tokens": 1},
    }
    yield _sse({"type": "message_start", "message": message}, "message_start"), False
    yield _sse({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}, "content_block_start"), False
    yield _sse({"type": "ping"}, "ping"), False
    for d in plan.deltas:
        yield _sse({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": d}}, "content_block_delta"), True
    yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"), False
    yield _sse({"type": "message_delta",
                "delta": {"stop_reason": _anthropic_stop(plan), "stop_sequence": None},
                "usage": {"output_tokens": plan.completion_tokens}}, "message_delta"), False
    yield _sse({"type": "message_stop"}, "message_stop"), False


def anthropic_json(plan: Plan) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
        "model": plan.model, "content": [{"type": "text", "text": plan.text}],
        "stop_reason": _anthropic_stop(plan), "stop_sequence": None,
        "usage": {"input_tokens": plan.prompt_tokens, "output_tokens": plan.completion_tokens},
    }


def _ollama_final(plan: Plan, started: float) -> dict[str, Any]:
    total = int((time.monotonic() - started) * 1e9)
    load = 850_000_000 if plan.cold else 0
    prompt_ns = 2_000_000 * max(1, plan.prompt_tokens // 10)
    return {
        "done": True, "done_reason": "length" if plan.truncated else "stop",
        "total_duration": total + load + prompt_ns, "load_duration": load,
        "prompt_eval_count": plan.prompt_tokens, "prompt_eval_duration": prompt_ns,
        "eval_count": plan.completion_tokens, "eval_duration": max(total, 1),
    }


def ollama_frames(plan: Plan, chat: bool, started: float) -> Iterator[Frame]:
    for d in plan.deltas:
        yield _ndjson(ollama_piece(plan, chat, d) | {"done": False}), True
    final = ollama_piece(plan, chat, "") | _ollama_final(plan, started)
    if not chat:
        final["context"] = list(range(1, plan.prompt_tokens + plan.completion_tokens + 1))
    yield _ndjson(final), False


def ollama_piece(plan: Plan, chat: bool, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": plan.model, "created_at": _now_iso()}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["response"] = text
    return out


def ollama_json(plan: Plan, chat: bool, started: float) -> dict[str, Any]:
    final = ollama_piece(plan, chat, plan.text) | _ollama_final(plan, started)
    if not chat:
        final["context"] = list(range(1, plan.prompt_tokens + plan.completion_tokens + 1))
    return final


