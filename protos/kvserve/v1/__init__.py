"""Generated protobuf and gRPC modules of the kvserve.v1 package, made from the .proto files here by `make protos`."""
