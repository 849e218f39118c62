"""Generated stubs of the public API, proto/splitserve/v1/splitserve.proto (regenerate with `make proto`)."""
