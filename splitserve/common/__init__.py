"""The bottom layer: small torch-free, gRPC-free helpers every other layer may import."""
