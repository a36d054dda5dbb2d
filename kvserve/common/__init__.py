"""Plumbing shared by the domains (worker, kvmanager) and the services on top: gRPC server setup, telemetry,
metrics, the KV-memory arithmetic, the tokenizer, typed errors, and the dataclasses that cross service
boundaries (``wire``) with their protobuf converters (``convert``). It imports no domain and no service."""
