"""`jobrunner serve`: the OpenAI Files and Batches API over HTTP on the queue
(docs/batch-api.md). Stateless: any number of replicas, all state in PostgreSQL.
One module of routes per surface (files, batches, health), and the web console (console/)."""
