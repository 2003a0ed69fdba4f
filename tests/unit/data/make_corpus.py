"""Generate the loop-detector corpus, offline and seeded.

    python tests/unit/data/make_corpus.py            # writes tests/unit/data/loop_corpus.jsonl.gz
                                                #    and tests/unit/data/request_corpus.jsonl.gz

Generation corpus, one JSON object per line: {id, label: legit|loop|ambiguous, category, text,
loop_start (char offset where the loop begins, loops only)}. Legitimately repetitive text
(tables, JSON arrays, CSV, logs, similar code lines, HTML lists, numbered lists, separators,
progress output) must never trip; loops (short phrase and long span) must. Prose comes from the
docstrings of a fixed list of stdlib modules, so no network is needed; everything else is built
from seeded random choices.

Request corpus: {id, label, category, requests: [chat request bodies in order]} for the retry
detector: legit multi-turn agents, batches, polling with progress, agents sharing a system prompt,
templated work where a word changes (a topic list cycled with a turn counter, file names in a
long template, ids without digits, templated questions in a chat); loops: exact re-sends,
re-sends with fresh UUIDs/timestamps/attempt counters, error feedback, A/B ping-pong, an A/B/C
cycle, the same tool call again and again, the model rephrasing its message on each retry.
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import random
import re
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20240611
PER_CATEGORY = 14

_MODULES = [
    "argparse", "asyncio", "collections", "csv", "datetime", "email", "functools", "gzip",
    "http.client", "inspect", "json", "logging", "os", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "sqlite3", "string", "subprocess", "tarfile", "textwrap", "threading",
    "typing", "unittest", "urllib.request", "uuid", "zipfile", "decimal", "fractions", "heapq",
    "itertools", "operator", "statistics", "tempfile", "traceback", "warnings", "weakref",
]


def _paragraphs() -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for name in _MODULES:
        mod = importlib.import_module(name)
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if not doc:
                continue
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if 120 <= len(para) <= 900 and ">>>" not in para and para not in seen:
                    seen.add(para)
                    out.append(para)
    return out


PARAS = _paragraphs()
WORDS = sorted({w for p in PARAS for w in re.findall(r"[a-z]{4,12}", p.lower())})
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy",
         "mallory", "niaj", "olivia", "peggy", "rupert", "sybil", "trent", "victor", "walter"]
CITIES = ["paris", "berlin", "lisbon", "oslo", "rome", "madrid", "vienna", "prague", "dublin",
          "athens", "warsaw", "zurich", "seoul", "tokyo", "lima", "quito", "cairo", "nairobi"]


def prose(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    for para in rng.sample(PARAS, 40):  # no paragraph twice: that would be a real repeat
        out.append(para)
        if sum(len(p) for p in out) >= chars:
            break
    return "\n\n".join(out)


def sentence(rng: random.Random) -> str:
    para = rng.choice(PARAS)
    sents = [s for s in re.split(r"(?<=\.) ", para) if 30 <= len(s) <= 200]
    return rng.choice(sents) if sents else para[:150]


def word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def fence(rng: random.Random, body: str, lang: str) -> str:
    return f"Here is the code:\n\n```{lang}\n{body}\n```\n\n{sentence(rng)}"


# --- legitimately repetitive ---------------------------------------------------------------

def legit_prose(rng):
    return prose(rng, rng.randint(1500, 5000))


def legit_md_table(rng):
    rows = ["| id | name | city | score | joined |", "|---:|------|------|------:|--------|"]
    for i in range(rng.randint(30, 160)):
        day = f"2023-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        rows.append(f"| {i + 1} | {rng.choice(NAMES)} | {rng.choice(CITIES)} | "
                    f"{rng.randint(0, 100)} | {day} |")
    return sentence(rng) + "\n\n" + "\n".join(rows) + "\n\n" + sentence(rng)


def legit_sparse_matrix(rng):
    feats = rng.sample(WORDS, rng.randint(30, 80))
    rows = ["| feature | basic | pro | enterprise |", "|---|---|---|---|"]
    for f in feats:
        cells = " | ".join(rng.choice(["yes", "no"]) for _ in range(3))
        rows.append(f"| {f} | {cells} |")
    return "Feature comparison:\n\n" + "\n".join(rows)


def legit_json_array(rng):
    items = []
    for i in range(rng.randint(30, 120)):
        items.append(json.dumps({"id": i + 1, "name": rng.choice(NAMES),
                                 "city": rng.choice(CITIES), "active": rng.random() < 0.5,
                                 "score": round(rng.random() * 100, 1), "tag": word(rng)}))
    return "```json\n[\n  " + ",\n  ".join(items) + "\n]\n```" if rng.random() < 0.5 else \
        "[" + ", ".join(items) + "]"


def legit_csv(rng):
    rows = ["date,region,product,units,revenue"]
    for _ in range(rng.randint(40, 200)):
        rows.append(f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d},{rng.choice(CITIES)},"
                    f"{word(rng)},{rng.randint(1, 500)},{rng.randint(100, 99999) / 100:.2f}")
    return "\n".join(rows)


def legit_logs(rng):
    lines = []
    t = rng.randint(0, 80000)
    for _ in range(rng.randint(40, 150)):
        t += rng.randint(1, 40)
        lvl = rng.choice(["INFO", "INFO", "INFO", "DEBUG", "WARNING"])
        msg = rng.choice([
            f"request {rng.randint(1000, 9999)} served in {rng.randint(2, 900)} ms",
            f"worker {rng.randint(1, 8)} picked job {rng.randint(10000, 99999)}",
            f"cache hit ratio {rng.random():.3f}",
            f"connected to {rng.choice(CITIES)}-db-{rng.randint(1, 4)}",
            f"{word(rng)} completed with status ok",
        ])
        lines.append(f"2024-05-{rng.randint(1, 28):02d} {t // 3600 % 24:02d}:{t // 60 % 60:02d}:"
                     f"{t % 60:02d},{rng.randint(0, 999):03d} {lvl} app.{word(rng)}: {msg}")
    return "\n".join(lines)


def legit_routes(rng):
    lines = ["from flask import Flask, jsonify", "", "app = Flask(__name__)", ""]
    for w in rng.sample(WORDS, rng.randint(20, 60)):
        m = rng.choice(["GET", "POST", "DELETE"])
        lines += [f'@app.route("/api/{w}/<int:item_id>", methods=["{m}"])',
                  f"def {m.lower()}_{w}(item_id):",
                  f"    return jsonify(db.{m.lower()}_{w}(item_id))", ""]
    body = "\n".join(lines)
    return fence(rng, body, "python") if rng.random() < 0.5 else body


def legit_pytest(rng):
    lines = ["import pytest", ""]
    for w in rng.sample(WORDS, rng.randint(15, 40)):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines += [f"def test_{w}_returns_expected_value():",
                  f"    result = {w}({a}, {b})",
                  f"    assert result == {a + b}", ""]
    body = "\n".join(lines)
    return fence(rng, body, "python") if rng.random() < 0.5 else body


def legit_enum(rng):
    lines = ["from enum import Enum", "", "class Kind(Enum):"]
    for i, w in enumerate(rng.sample(WORDS, rng.randint(30, 90))):
        lines.append(f"    {w.upper()} = {i + 1}")
    body = "\n".join(lines)
    return fence(rng, body, "python") if rng.random() < 0.5 else body


def legit_getters(rng):
    lines = ["class Record:"]
    for w in rng.sample(WORDS, rng.randint(15, 40)):
        lines += ["    @property", f"    def {w}(self):", f"        return self._{w}", ""]
    body = "\n".join(lines)
    return fence(rng, body, "python") if rng.random() < 0.5 else body


def legit_html_list(rng):
    items = [f'  <li><a href="/docs/{w}.html">{w.title()}</a></li>'
             for w in rng.sample(WORDS, rng.randint(30, 120))]
    return "<ul>\n" + "\n".join(items) + "\n</ul>"


def legit_sql(rng):
    rows = [f"INSERT INTO users (id, name, city, age) VALUES ({i}, '{rng.choice(NAMES)}', "
            f"'{rng.choice(CITIES)}', {rng.randint(18, 90)});" for i in range(rng.randint(30, 150))]
    return "\n".join(rows)


def legit_numbered_list(rng):
    return "Plan:\n" + "\n".join(f"{i + 1}. {sentence(rng)}" for i in range(rng.randint(10, 40)))


def legit_separators(rng):
    out = []
    for _ in range(rng.randint(4, 10)):
        rule = rng.choice(["=" * 80, "-" * 60, "─" * 72, "*" * 40, "#" * 50, "=-" * 30])
        out += [f"## {word(rng).title()}", rule, prose(rng, 300), rule]
    return "\n".join(out)


def legit_progress(rng):
    total = rng.randint(40, 150)
    return "\n".join(f"[{i + 1}/{total}] processing {word(rng)}.json ... ok "
                     f"({rng.randint(5, 999)} rows, {rng.random() * 3:.2f}s)" for i in range(total))


def legit_box(rng):
    width = rng.randint(40, 70)
    rows = ["┌" + "─" * width + "┐"]
    for _ in range(rng.randint(10, 40)):
        s = f" {word(rng)}: {rng.randint(0, 9999)}"
        rows.append("│" + s.ljust(width) + "│")
    rows.append("└" + "─" * width + "┘")
    return "\n".join(rows)


LEGIT = {k[6:]: v for k, v in globals().items() if k.startswith("legit_")}


# --- loops ---------------------------------------------------------------------------------

def _loop(prefix: str, body: str) -> tuple[str, int]:
    return prefix + body, len(prefix)


def loop_sentence(rng):
    s = sentence(rng) + " "
    return _loop(prose(rng, rng.randint(200, 1500)) + "\n\n", s * rng.randint(8, 30))


def loop_paragraph(rng):
    p = prose(rng, rng.randint(250, 700)) + "\n\n"
    return _loop(prose(rng, rng.randint(200, 1500)) + "\n\n", p * rng.randint(5, 12))


def loop_near_dup_paragraph(rng):
    base = prose(rng, rng.randint(250, 600)).split()
    copies = []
    for i in range(rng.randint(6, 12)):
        words = list(base)
        for _ in range(max(1, len(words) * rng.randint(2, 4) // 100)):
            words[rng.randrange(len(words))] = word(rng)
        copies.append(f"Attempt {i + 1}: " + " ".join(words))
    return _loop(prose(rng, rng.randint(200, 1200)) + "\n\n", "\n\n".join(copies))


def loop_short_phrase(rng):
    phrase = rng.choice(["the ", "I apologize for the confusion. ", "** ", "0 ", "ok ",
                         "Let me try again. ", "the the ", "...\n", "<|im_start|>", "1, "])
    n = rng.randint(60, 300)
    return _loop(prose(rng, rng.randint(200, 1500)) + " ", phrase * n)


def loop_list_cycle(rng):
    items = [sentence(rng) for _ in range(rng.randint(2, 4))]
    start = rng.randint(1, 5)
    body = "\n".join(f"{start + i}. {items[i % len(items)]}" for i in range(rng.randint(20, 60)))
    head = "Steps:\n" + "\n".join(f"{i}. {sentence(rng)}" for i in range(1, start))
    return _loop(head + "\n", body)


def loop_thinking(rng):
    tpl = [f"Wait, let me reconsider the {word(rng)}. " + sentence(rng),
           f"Actually, I think the {word(rng)} is wrong. " + sentence(rng),
           f"Hmm, but then the {word(rng)} would not match. " + sentence(rng)]
    body = "\n".join(tpl[i % 3] for i in range(rng.randint(15, 40)))
    return _loop(prose(rng, rng.randint(200, 1200)) + "\n", body)


def loop_json_object(rng):
    obj = json.dumps({"id": rng.randint(1, 99), "name": rng.choice(NAMES),
                      "city": rng.choice(CITIES), "tag": word(rng)})
    head = "[" + ", ".join(json.dumps({"id": i, "name": rng.choice(NAMES)})
                           for i in range(5)) + ", "
    return _loop(head, ", ".join([obj] * rng.randint(15, 60)))


def loop_table_row(rng):
    head = "| id | name | city |\n|---|---|---|\n" + "\n".join(
        f"| {i} | {rng.choice(NAMES)} | {rng.choice(CITIES)} |" for i in range(1, 6)) + "\n"
    row = f"| 6 | {rng.choice(NAMES)} | {rng.choice(CITIES)} |\n"
    return _loop(head, row * rng.randint(15, 60))


def loop_code_block(rng):
    w = word(rng)
    fn = (f"def handle_{w}(request):\n    data = request.get_json()\n"
          f"    if not data:\n        return error('{w} missing')\n    return ok(data)\n\n")
    return _loop("```python\n", fn * rng.randint(5, 15))


def loop_long_block(rng):
    block = "\n".join(f"    {word(rng)}_{i} = compute_{word(rng)}(x, {rng.randint(0, 99)})"
                      for i in range(rng.randint(20, 40))) + "\n"
    return _loop("```python\ndef run(x):\n", block * rng.randint(4, 8))


LOOPS = {k[5:]: v for k, v in globals().items() if k.startswith("loop_")}


def ambiguous_requested(rng):
    s = rng.choice(["I will not talk in class.", "All work and no play.", "Hello world!"])
    return "\n".join([s] * rng.randint(20, 50))


def ambiguous_chorus(rng):
    chorus = "\n".join(sentence(rng) for _ in range(3))
    return "\n\n".join(f"{prose(rng, 200)}\n\n{chorus}" for _ in range(rng.randint(3, 6)))


AMBIGUOUS = {"requested": ambiguous_requested, "chorus": ambiguous_chorus}


# --- request streams -------------------------------------------------------------------------

SYSTEM = "You are a careful coding agent. Use the tools to inspect and edit the repository."


def req(messages, model="qwen2.5:7b"):
    return {"model": model, "stream": True, "messages": messages}


def rq_agent(rng):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sentence(rng)}]
    out = []
    for _ in range(rng.randint(8, 20)):
        out.append(req(list(msgs)))
        call = {"name": rng.choice(["read_file", "grep", "run_tests", "edit"]),
                "arguments": json.dumps({"path": f"src/{word(rng)}.py"})}
        msgs.append({"role": "assistant", "content": sentence(rng),
                     "tool_calls": [{"id": f"call_{uuid.UUID(int=rng.getrandbits(128)).hex[:24]}",
                                     "type": "function", "function": call}]})
        msgs.append({"role": "tool", "content": prose(rng, rng.randint(100, 400))})
    return out


def rq_batch(rng):
    tpl = "Classify the sentiment of this review as positive or negative. Review: "
    return [req([{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": tpl + sentence(rng)}])
            for _ in range(rng.randint(8, 20))]


def rq_polling(rng):
    out, done = [], 0
    for i in range(rng.randint(8, 20)):
        done = min(100, done + rng.randint(3, 15))
        out.append(req([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Is the build finished?"},
                        {"role": "tool", "content": f"build {done}% complete, {i * 7 + 3} of 140 "
                                                    f"targets compiled"}]))
    return out


def rq_shared_system(rng):
    return [req([{"role": "system", "content": SYSTEM + " " + prose(rng, 800)},
                 {"role": "user", "content": f"Summarise {word(rng)}.py: " + sentence(rng)}])
            for _ in range(rng.randint(8, 20))]


def rq_exact(rng):
    body = req([{"role": "system", "content": SYSTEM}, {"role": "user", "content": sentence(rng)}])
    return [body] * rng.randint(8, 14)


def rq_jitter(rng):
    q = sentence(rng)
    out = []
    for i in range(rng.randint(8, 14)):
        stamp = f"2024-06-11T10:{i:02d}:{rng.randint(0, 59):02d}Z"
        rid = uuid.UUID(int=rng.getrandbits(128))
        out.append(req([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"[request {rid} at {stamp}] "
                                                    f"attempt {i + 1}/50: {q}"}]))
    return out


def rq_error_feedback(rng):
    bad = '{"name": "' + word(rng) + '", "args": [1, 2'
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sentence(rng)}]
    out = []
    for _ in range(rng.randint(8, 14)):
        out.append(req(list(msgs)))
        msgs.append({"role": "assistant", "content": bad})
        msgs.append({"role": "user", "content": "Invalid JSON: Expecting ',' delimiter. "
                                                "Reply with valid JSON only."})
    return out


def rq_ping_pong(rng):
    a = [{"role": "assistant", "content": "Let me open the config."},
         {"role": "tool", "content": "config.yaml: permission denied"}]
    b = [{"role": "assistant", "content": "Let me list the directory."},
         {"role": "tool", "content": "config.yaml  main.py  README.md"}]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sentence(rng)}]
    out = []
    for i in range(rng.randint(10, 16)):
        msgs = msgs + (a if i % 2 == 0 else b)
        out.append(req(list(msgs)))
    return out


def rq_same_tool_call(rng):
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "x", "type": "function", "function": {
                "name": "search", "arguments": json.dumps({"query": word(rng)})}}]}
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sentence(rng)}]
    out = []
    for _ in range(rng.randint(8, 14)):
        call = json.loads(json.dumps(call))
        call["tool_calls"][0]["id"] = f"call_{uuid.UUID(int=rng.getrandbits(128)).hex}"
        msgs = msgs + [call, {"role": "tool", "content": "no results"}]
        out.append(req(list(msgs)))
    return out


TEMPLATE_LONG = ("Read the file below and write a short review. List at most three problems, "
                 "each with the line it is on and a one-line fix. Do not rewrite the file. "
                 "Keep the answer under 120 words and use plain text, no markdown. ")


def rq_template_cycle(rng):
    # The demo `leaky` agent: "Turn N: explain TOPIC ..." cycling through a list of topics.
    topics = rng.sample(WORDS, rng.randint(5, 10))
    return [req([{"role": "user", "content": f"Turn {i}: explain {topics[i % len(topics)]} "
                                             f"in a few sentences."}])
            for i in range(1, rng.randint(16, 30))]


def rq_template_files(rng):
    files = rng.sample(WORDS, 20)
    return [req([{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": TEMPLATE_LONG + f"File: src/{f}.py"}])
            for f in files[: rng.randint(8, 20)]]


def rq_template_ids(rng):
    # ids that are not counters and carry no digits, so nothing masks them
    ids = ["-".join(rng.sample(NAMES, 2)) for _ in range(20)]
    verb = rng.choice(["Look up the account of", "Draft a reply to", "Summarise the tickets of"])
    return [req([{"role": "user", "content": f"{verb} customer {c}."}])
            for c in ids[: rng.randint(8, 20)]]


def rq_template_chat(rng):
    # multi-turn: the model's answer, then the next templated question
    cities = rng.sample(CITIES, 12)
    msgs = [{"role": "system", "content": SYSTEM}]
    out = []
    for city in cities[: rng.randint(8, 12)]:
        msgs = msgs + [{"role": "user", "content": f"What is the weather like in {city}?"}]
        out.append(req(list(msgs)))
        msgs = msgs + [{"role": "assistant", "content": sentence(rng)}]
    return out


def rq_cycle3(rng):
    calls = [f"Open {word(rng)}.py" for _ in range(3)]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sentence(rng)}]
    out = []
    for i in range(rng.randint(10, 16)):
        msgs = msgs + [{"role": "assistant", "content": calls[i % 3]},
                       {"role": "tool", "content": "error: file is locked"}]
        out.append(req(list(msgs)))
    return out


def rq_rephrased(rng):
    # The model rephrases its own message a little on each retry; the tool error stays.
    base = sentence(rng) + " " + sentence(rng)
    openers = ["I will try again.", "I will try once more.", "I will retry now.",
               "I will try it again."]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sentence(rng)}]
    out = []
    for _ in range(rng.randint(8, 14)):
        msgs = msgs + [{"role": "assistant", "content": base + " " + rng.choice(openers)},
                       {"role": "tool", "content": "error: connection refused"}]
        out.append(req(list(msgs)))
    return out


REQ_LEGIT = {"agent": rq_agent, "batch": rq_batch, "polling": rq_polling,
             "shared_system": rq_shared_system, "template_cycle": rq_template_cycle,
             "template_files": rq_template_files, "template_ids": rq_template_ids,
             "template_chat": rq_template_chat}
REQ_LOOPS = {"exact": rq_exact, "jitter": rq_jitter, "error_feedback": rq_error_feedback,
             "ping_pong": rq_ping_pong, "same_tool_call": rq_same_tool_call,
             "cycle3": rq_cycle3, "rephrased": rq_rephrased}


def _write(path: Path, items: list[dict]) -> None:
    data = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items).encode()
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        fh.write(data)  # mtime=0: the same seed gives the same bytes


def main() -> None:
    rng = random.Random(SEED)
    samples = []
    for label, table in (("legit", LEGIT), ("loop", LOOPS), ("ambiguous", AMBIGUOUS)):
        for cat, fn in table.items():
            for i in range(PER_CATEGORY if label != "ambiguous" else 6):
                item = {"id": f"{label}/{cat}/{i}", "label": label, "category": cat}
                made = fn(rng)
                if isinstance(made, tuple):
                    item["text"], item["loop_start"] = made
                else:
                    item["text"] = made
                samples.append(item)
    _write(HERE / "loop_corpus.jsonl.gz", samples)
    reqs = []
    for label, table in (("legit", REQ_LEGIT), ("loop", REQ_LOOPS)):
        for cat, fn in table.items():
            for i in range(10):
                reqs.append({"id": f"{label}/{cat}/{i}", "label": label, "category": cat,
                             "requests": fn(rng)})
    _write(HERE / "request_corpus.jsonl.gz", reqs)
    chars = sum(len(s["text"]) for s in samples)
    print(f"{len(samples)} texts ({chars} chars), {len(reqs)} request streams")


if __name__ == "__main__":
    main()
