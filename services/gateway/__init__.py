"""The gateway: public API, continuous batching and the engine loops that drive the kvmanager and workers."""
