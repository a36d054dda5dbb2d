"""The kvmanager: owner of every page of every worker's KV pool.

Domain modules here (``hashing``, ``pool``, ``manager``, ``errors``, ``types``) are plain Python: no grpc, no
generated protobuf modules. ``store`` persists the state to Redis; ``servicer``/``server`` expose it.
"""
