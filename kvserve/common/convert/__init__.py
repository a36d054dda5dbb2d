"""Protobuf <-> the ``common.wire`` dataclasses, in one place per message family: each direction is used by one
side of a hop (the servicer, or the client calling it). No logic beyond renaming and copying."""
