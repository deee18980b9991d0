"""Chunked summarisation: one task per chunk of a document in the bundled corpus.

Offline by default: a deterministic extractive summariser (sentence scoring by word
frequency). When JOBRUNNER_LLM_BASE_URL is set, an OpenAI-compatible chat completions
endpoint writes the summary instead (JOBRUNNER_LLM_MODEL, JOBRUNNER_LLM_API_KEY), with
the task's idempotency key sent as the Idempotency-Key header.

Flow control (docs/flow-control.md): every summary reports its token counts with
task.report_usage (the endpoint's `usage` when it answers one, else an estimate of
about four characters per token; cost from JOBRUNNER_LLM_COST_PER_1K_TOKENS, default
0), so `jobrunner usage --batch B` shows what the batch used. An HTTP 429 from the
endpoint becomes RateLimited with its Retry-After, which pauses the limit named by
JOBRUNNER_LLM_LIMIT (default: every limit the task names) for every worker without
using an attempt.

Each summary is stored through the effects helper (`task.once`), so a retry after a
crash never writes it twice.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from psycopg.types.json import Jsonb

from jobrunner import RateLimited, Task

CORPUS = Path(__file__).parent / "corpus"
CHUNK_CHARS = 900
_WORD = re.compile(r"[a-z][a-z'-]+")
_STOP = set(
    "a an the and or of to in is are be by for with as on it this that from at which can "
    "not if its into their they may will when than then these those such".split())


def chunks(doc: str, size: int = CHUNK_CHARS) -> list[str]:
    """Split a document into chunks of whole paragraphs of about `size` characters."""
    text = (CORPUS / f"{doc}.txt").read_text()
    out: list[str] = []
    current = ""
    for para in re.split(r"\n\s*\n", text):
        if current and len(current) + len(para) > size:
            out.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        out.append(current)
    return out


def extractive_summary(text: str, sentences: int = 2) -> str:
    parts = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s.strip()]
    if len(parts) <= sentences:
        return " ".join(parts)
    freq = Counter(w for w in _WORD.findall(text.lower()) if w not in _STOP)

    def score(sentence: str) -> float:
        words = [w for w in _WORD.findall(sentence.lower()) if w not in _STOP]
        return sum(freq[w] for w in words) / (len(words) + 3)

    best = sorted(range(len(parts)), key=lambda i: (-score(parts[i]), i))[:sentences]
    return " ".join(parts[i] for i in sorted(best))


def approx_tokens(text: str) -> int:
    """About four characters per token: what the offline summariser reports."""
    return max(1, len(text) // 4)


def llm_summary(text: str, idempotency_key: str) -> tuple[str, dict]:
    """The endpoint's summary and its `usage` ({} when it reports none)."""
    base = os.environ["JOBRUNNER_LLM_BASE_URL"].rstrip("/")
    body = {
        "model": os.environ.get("JOBRUNNER_LLM_MODEL", "gpt-4o-mini"),
        "messages": [
            {"role": "system", "content": "Summarise the text in two sentences."},
            {"role": "user", "content": text},
        ],
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base}/chat/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key,
                 "Authorization": f"Bearer {os.environ.get('JOBRUNNER_LLM_API_KEY', '')}"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 429:  # no attempt used; the limit waits for every worker
            raise RateLimited(retry_after=_retry_after(exc.headers.get("Retry-After")),
                              limit=os.environ.get("JOBRUNNER_LLM_LIMIT") or None) from None
        raise
    return answer["choices"][0]["message"]["content"].strip(), answer.get("usage") or {}


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 30.0
    except ValueError:  # an HTTP date: wait the default
        return 30.0


def summarise_chunk(task: Task) -> dict:
    doc, index = task.payload["doc"], task.payload["chunk"]
    text = chunks(doc)[index]
    # Stand-in for model latency, so the progress bar has something to show.
    time.sleep(float(task.payload.get("latency", 0.25)))
    if task.payload.get("flaky") and task.attempt == 1:
        raise RuntimeError("429 Too Many Requests (simulated rate limit; retried with backoff)")
    if os.environ.get("JOBRUNNER_LLM_BASE_URL"):
        summary, usage = llm_summary(text, task.idempotency_key("summary"))
    else:
        summary, usage = extractive_summary(text), {}
    prompt = int(usage.get("prompt_tokens") or approx_tokens(text))
    completion = int(usage.get("completion_tokens") or approx_tokens(summary))
    per_1k = float(os.environ.get("JOBRUNNER_LLM_COST_PER_1K_TOKENS", "0"))
    task.report_usage(input_tokens=prompt, output_tokens=completion,
                      cost=round((prompt + completion) * per_1k / 1000, 6))
    record = {"doc": doc, "chunk": index, "summary": summary, "chars": len(text)}

    def store(conn) -> dict:
        conn.execute("CREATE TABLE IF NOT EXISTS demo_chunk_summary ("
                     " batch_id text, doc text, chunk int, summary jsonb,"
                     " PRIMARY KEY (batch_id, doc, chunk))")
        conn.execute("INSERT INTO demo_chunk_summary VALUES (%s, %s, %s, %s)",
                     (task.batch_id, doc, index, Jsonb(record)))
        return {"stored": True}

    task.once("store-summary", store)
    return record
