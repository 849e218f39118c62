"""The client side of splitserve: the gRPC client (``grpc_client``: ``Client``, exported here), the
command-line flags for TLS and API keys (``flags``) and the ``splitserve status`` table (``status_view``).
None of it imports torch."""

from splitserve.client.grpc_client import Client, Completion, make_request

__all__ = ["Client", "Completion", "make_request"]
