"""Example batch: chunked summarisation of a small bundled corpus."""
