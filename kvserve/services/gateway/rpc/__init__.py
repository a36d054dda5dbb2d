"""The gateway over gRPC: its clients of the kvmanager and of the workers, its public servicer and server. The
core (kvserve/services/gateway) knows none of this; a second front-end sits beside this one."""
