"""What the prefill and the decode worker share: configuration, the gRPC server, the engine loop's
skeleton and status reporting."""
