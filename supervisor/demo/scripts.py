"""Scripted answers for the mock LLM backend.

The demo fleet must show every failure fleettop catches without a GPU, so each demo model name
stands for one behaviour (healthy prose, a token loop, a slow stream, a server error, legit
repetitive JSON). Answers are pure functions of (model, prompt): the same request always
streams the same deltas, which keeps proxy/detector tests reproducible.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What /api/tags and /api/ps report for a demo model (sizes look like small GGUFs)."""

    name: str
    behaviour: str
    family: str
    parameter_size: str
    quantization_level: str
    size: int
    size_vram: int
    context_length: int = 4096

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.name.encode()).hexdigest()


GIB = 1024**3
MODELS: dict[str, ModelInfo] = {
    m.name: m
    for m in (
        ModelInfo("demo-chat", "varied prose", "llama", "3.2B", "Q4_K_M", 2 * GIB, 2 * GIB),
        ModelInfo("demo-loop", "degenerate token loop", "llama", "1.2B", "Q4_K_M", GIB, GIB),
        ModelInfo("demo-slow", "slow token stream", "qwen2", "7.6B", "Q4_K_M", 5 * GIB, 4 * GIB),
        ModelInfo("demo-error", "HTTP 500", "llama", "1.2B", "Q4_0", GIB, GIB),
        ModelInfo("demo-json", "legit repetitive JSON/table", "qwen2", "1.5B", "Q8_0", GIB, GIB),
    )
}

_OPENINGS = [
    "Sure, here is a short answer.",
    "Good question.",
    "Here is what I found.",
    "Let me walk through it.",
    "In short, it depends on the workload.",
]
_SENTENCES = [
    "The scheduler keeps one heavy model on the GPU at a time and queues the rest.",
    "Most of the latency comes from loading weights, not from generating tokens.",
    "A smaller quantisation trades a little quality for a lot of free memory.",
    "Cron workers that miss the lock simply try again at their next slot.",
    "Streaming responses let the caller show progress before the answer is complete.",
    "Caching the prompt prefix saves time when many requests share a system message.",
    "Logs are easier to read when every line starts with the agent name.",
    "A memory leak shows up as a steady climb rather than a single spike.",
    "Retries should back off, otherwise a failing backend gets hammered.",
    "The context window fills faster than expected when tool output is verbose.",
    "Evicting an idle model frees VRAM for the next queued request.",
    "Batching short prompts together improves throughput on a small card.",
    "Health checks catch a crashed runner before users notice.",
    "Measuring tokens per second per agent makes regressions obvious.",
    "A clear stop condition keeps an agent from wandering off task.",
]
_CLOSINGS = [
    "Let me know if you want more detail.",
    "That should cover the main points.",
    "Hope that helps.",
    "I can expand on any of these.",
]
_LOOP_PHRASE = "I will check the configuration file again to be sure. "
_CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Denver", "Hanoi", "Tunis", "Perth",
           "Quito", "Riga", "Cusco", "Dakar", "Turin", "Busan", "Leeds"]
_CONDITIONS = ["clear", "cloudy", "rain", "drizzle", "fog", "windy", "snow", "storm"]

LOOP_TOKENS = 4000
"""Length of the degenerate answer: long enough that a breaker trips well before it ends."""


def estimate_tokens(text: str) -> int:
    """Rough BPE token count (~4 characters a token), good enough for usage fields."""
    return math.ceil(len(text) / 4) if text else 0


def _rng(model: str, prompt: str) -> random.Random:
    digest = hashlib.sha256(f"{model}\0{prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _prose(rng: random.Random, closing: bool = True) -> str:
    body = rng.sample(_SENTENCES, rng.randint(3, 6))
    tail = [rng.choice(_CLOSINGS)] if closing else []
    return " ".join([rng.choice(_OPENINGS), *body, *tail])


def _loop(rng: random.Random) -> str:
    # Starts like a healthy answer, then degenerates: what a small model does at temperature 0.
    head = _prose(rng, closing=False) + " Before answering, "
    reps = math.ceil((LOOP_TOKENS * 4 - len(head)) / len(_LOOP_PHRASE))
    return head + _LOOP_PHRASE * reps


def _json_rows(rng: random.Random, n: int) -> list[dict[str, object]]:
    ids = [1000]
    for _ in range(n - 1):
        ids.append(ids[-1] + rng.randint(1, 9))
    return [
        {
            "id": ids[i],
            "city": rng.choice(_CITIES),
            "temp_c": round(rng.uniform(-12, 38), 1),
            "humidity": rng.randint(12, 98),
            "wind_kph": round(rng.uniform(0, 65), 1),
            "conditions": rng.choice(_CONDITIONS),
        }
        for i in range(n)
    ]


def _structured(rng: random.Random, prompt: str) -> str:
    rows = _json_rows(rng, rng.randint(18, 26))
    if "table" in prompt.lower():
        cols = list(rows[0])
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    return json.dumps(rows, indent=2) + "\n"


def answer_text(model: str, prompt: str) -> str:
    """The full scripted answer for a known demo model (demo-error has none)."""
    base = model.split(":", 1)[0]
    rng = _rng(base, prompt)
    if base == "demo-loop":
        return _loop(rng)
    if base == "demo-json":
        return _structured(rng, prompt)
    return _prose(rng)


_PIECE = re.compile(r"\S+\s*|\s+")


def split_deltas(text: str, seed: str = "") -> list[str]:
    """Cut text into stream deltas of 1-4 words; joined, they give the text back exactly."""
    pieces = _PIECE.findall(text)
    rng = _rng("split", seed or text[:64])
    out: list[str] = []
    i = 0
    while i < len(pieces):
        n = rng.randint(1, 4)
        out.append("".join(pieces[i : i + n]))
        i += n
    return out


def truncate_deltas(deltas: list[str], max_tokens: int | None) -> tuple[list[str], bool]:
    """Keep deltas while the answer fits max_tokens; returns (deltas, truncated)."""
    if not max_tokens or max_tokens <= 0:
        return deltas, False
    kept: list[str] = []
    used = 0
    for d in deltas:
        used += estimate_tokens(d)
        if used > max_tokens:
            return kept, True
        kept.append(d)
    return kept, False
