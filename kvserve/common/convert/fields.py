"""Copying between a dataclass and a protobuf message whose fields have the same names."""

from __future__ import annotations

from dataclasses import fields


def as_kwargs(obj) -> dict:
    """A dataclass instance's fields, by name."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def to_message(obj, message_type):
    """A message of ``message_type`` with the scalar and repeated-scalar fields of a dataclass of the same names."""
    return message_type(**as_kwargs(obj))
