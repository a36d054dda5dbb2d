"""Plain dataclasses that cross service boundaries (inputs frozen). No protobuf here: ``common.convert`` turns
them into messages and back, so code that only computes with them never loads gRPC."""
