"""Chunked summarisation as map-reduce: one task per chunk of a document in the bundled
corpus (summarise_chunk), then the batch's reduce step (digest): one digest per document
from its chunks' summaries, and an overall digest from those.

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

Each summary, and each document's digest, is stored through the effects helper
(`task.once`), so a retry after a crash never writes it twice.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def llm_summary(text: str, idempotency_key: str, sentences: int = 2) -> tuple[str, dict]:
    """The endpoint's summary and its `usage` ({} when it reports none)."""
    return chat(f"Summarise the text in {sentences} sentence(s).", text, idempotency_key)


def chat(instruction: str, text: str, idempotency_key: str) -> tuple[str, dict]:
    """One chat completion of the OpenAI-compatible endpoint at JOBRUNNER_LLM_BASE_URL
    (also used by examples/tickets): its answer and `usage` ({} when it reports none).
    HTTP 429 raises RateLimited with the endpoint's Retry-After."""
    base = os.environ["JOBRUNNER_LLM_BASE_URL"].rstrip("/")
    body = {
        "model": os.environ.get("JOBRUNNER_LLM_MODEL", "gpt-4o-mini"),
        "messages": [
            {"role": "system", "content": instruction},
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


# -- the reduce step ----------------------------------------------------------------
DIGEST_CHARS = 180  # per document: the whole digest stays small enough for a status


def clip(text: str, limit: int) -> str:
    """At most `limit` characters, cut at a word."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " …"


def condense(task: Task, texts: list[str], sentences: int, what: str) -> str:
    """The "model" of the reduce: extractive offline, the endpoint when configured."""
    joined = " ".join(texts)
    if os.environ.get("JOBRUNNER_LLM_BASE_URL"):
        summary, usage = llm_summary(joined, task.idempotency_key(what), sentences)
        task.report_usage(input_tokens=int(usage.get("prompt_tokens") or approx_tokens(joined)),
                          output_tokens=int(usage.get("completion_tokens")
                                            or approx_tokens(summary)))
        return summary
    time.sleep(0.15)  # stand-in for model latency, so the reduce shows on the progress bar
    return extractive_summary(joined, sentences)


def overview(documents: list[dict[str, Any]], chunks_total: int) -> str:
    """The offline overall digest: what recurs across the documents' digests, and which
    documents the batch covered most."""
    words = Counter(w for d in documents for w in set(_WORD.findall(d["digest"].lower()))
                    if w not in _STOP and len(w) > 3)
    recurring = [w for w, n in words.most_common(8) if n > 1] or [w for w, _ in
                                                                  words.most_common(5)]
    largest = sorted(documents, key=lambda d: (-d["chunks"], d["doc"]))[:3]
    return (f"{len(documents)} documents in {chunks_total} chunks. Recurring terms: "
            f"{', '.join(recurring)}. Most covered: "
            + ", ".join(f"{d['doc']} ({d['chunks']} chunks)" for d in largest) + ".")


def digest(task: Task, results: Iterator[dict[str, Any]]) -> str:
    """The batch's reduce step: a digest per document from its chunks' summaries, then an
    overall digest from those; returns the digest as Markdown (the batch's result).

    `results` streams the chunk results in task key order (argparse-00, argparse-01, ...
    configparser-00, ...), so a document's chunks come together: one document's
    summaries are in memory at a time, however large the batch."""
    documents: list[dict[str, Any]] = []
    done = (r for r in results if r["status"] == "done" and r["result"])
    for doc, group in itertools.groupby(done, key=lambda r: r["result"]["doc"]):
        summaries = [r["result"]["summary"] for r in group]
        documents.append({"doc": doc, "chunks": len(summaries),
                          "digest": clip(condense(task, summaries, 1, f"digest-{doc}"),
                                         DIGEST_CHARS)})
    chunks_total = sum(d["chunks"] for d in documents)
    if os.environ.get("JOBRUNNER_LLM_BASE_URL"):
        overall = clip(condense(task, [d["digest"] for d in documents], 3, "digest"), 600)
    else:
        overall = overview(documents, chunks_total)

    def store(conn) -> dict:
        conn.execute("CREATE TABLE IF NOT EXISTS demo_digest ("
                     " batch_id text, doc text, chunks int, digest text,"
                     " PRIMARY KEY (batch_id, doc))")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO demo_digest VALUES (%s, %s, %s, %s)",
                            [(task.batch_id, d["doc"], d["chunks"], d["digest"])
                             for d in documents])
        return {"documents": len(documents)}

    task.once("store-digests", store)
    lines = [f"# Digest of {len(documents)} documents ({chunks_total} chunks)", "", overall, "",
             "## By document"]
    lines += [f"- {d['doc']} ({d['chunks']} chunks): {d['digest']}" for d in documents]
    return "\n".join(lines) + "\n"
