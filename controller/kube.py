"""One Kubernetes API client for the whole controller process.

`client.BatchV1Api()` without an argument builds a new ApiClient, hence a new
connection pool and a TLS handshake, on every call; with 100 BatchRuns refreshed every
few seconds that handshake was most of the controller's CPU (bench, controller stage).
The ApiClient's urllib3 pool is thread-safe, so kopf's handler threads share it.
"""

from __future__ import annotations

import threading

from kubernetes import client

POOL_SIZE = 32
_lock = threading.Lock()
_client: client.ApiClient | None = None


def api_client() -> client.ApiClient:
    """The shared client, created on first use (after the kubeconfig was loaded)."""
    global _client
    with _lock:
        if _client is None:
            config = client.Configuration.get_default_copy()
            # Up to one connection per kopf handler thread (urllib3's default pool of 10
            # discarded connections, with a warning, once 100 BatchRuns were refreshed).
            config.connection_pool_maxsize = POOL_SIZE
            _client = client.ApiClient(config)
        return _client


def batch_api() -> client.BatchV1Api:
    return client.BatchV1Api(api_client())


def core_api() -> client.CoreV1Api:
    return client.CoreV1Api(api_client())


def apps_api() -> client.AppsV1Api:
    return client.AppsV1Api(api_client())


def custom_api() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())
