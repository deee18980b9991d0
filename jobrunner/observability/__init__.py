"""Observability: OpenTelemetry traces of enqueues and attempts (docs/observability.md). The
lowest layer: it imports nothing of jobrunner, so every layer may record spans."""
