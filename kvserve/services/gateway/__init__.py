"""The gateway: the transport-free core (continuous batching, one engine loop per worker, request lifecycle,
placement and admission) over the backend protocols of backends.py, and rpc/, its gRPC clients and front-end."""
