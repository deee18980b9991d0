"""The web console under /console of `jobrunner serve` (docs/console.md): server-rendered
pages of batches and tasks, live over server-sent events, and the admin's actions.
Its templates and static files are package data, shipped in the wheel."""
