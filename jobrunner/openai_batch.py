"""The OpenAI-compatible handler under its public name: `--handler jobrunner.openai_batch:handle`
(the code is jobrunner.features.openai_batch)."""

from jobrunner.features.openai_batch import handle

__all__ = ["handle"]
