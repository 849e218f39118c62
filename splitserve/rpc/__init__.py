"""Generated gRPC/protobuf stubs for the .proto files in proto/splitserve/rpc (regenerate with `make proto`)."""
