"""The UCX transports of the end-to-end tests: the node processes'
environment, and the ``ucx_backend_params`` vLLM passes to NIXL's UCX
backend (shared memory alone needs UCX error handling "none"; TCP runs with
vLLM's defaults)."""

TRANSPORTS: dict[str, tuple[dict[str, str], dict[str, str] | None]] = {
    "shm": ({"UCX_TLS": "shm"}, {"ucx_error_handling_mode": "none"}),
    "tcp": ({"UCX_TLS": "tcp"}, None),
}
