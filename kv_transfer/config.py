"""Settings of the KV transfer layer. Its fault points (tests) are part of the process's one fault object
(splitserve/common/faults.py): an endpoint gets its hooks as ``faults=``, next to this config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from splitserve.common.faults import FaultAction, FaultPoint, Role
from splitserve.common.validate import check_choice, check_range, check_ranges

__all__ = ["BACKENDS", "FaultAction", "FaultPoint", "Role", "TransferConfig"]

BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class TransferConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL when the KV lives on CUDA, else gloo
    pair_setup_timeout_s: float = 10.0  # control stream + group rendezvous
    op_timeout_s: float = 5.0  # one payload send or receive
    # A whole transfer: the sender's from its start to done; the receiver's from the sender's first message to
    # done (an expect given a timeout of its own: from the expect).
    transfer_timeout_s: float = 60.0
    # A receiver's wait, from expect, for the sender's first message of a transfer: a decode worker's lease is
    # granted before the prompt's prefill begins, and the prompt may queue on its prefill worker first. The
    # router ends a lease whose prefill failed or was cancelled at once (docs/kv_transfer.md), so this only
    # bounds a sender that never begins.
    transfer_start_timeout_s: float = 600.0
    max_pairs: int = 64  # groups kept per endpoint; least recently used idle pairs are closed beyond it
    max_message_bytes: int = 8 << 20  # payload messages are packed up to this size
    whole_request_bytes: int = 4 << 20  # below this a request goes in one message, not by layer group
    layer_group_size: int = 4  # layers per streamed group
    max_descriptor_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        check_choice(self, "backend", BACKENDS)
        check_ranges(
            self, ("pair_setup_timeout_s", "op_timeout_s", "transfer_timeout_s", "transfer_start_timeout_s"), above=0
        )
        check_ranges(self, ("max_pairs", "max_message_bytes", "layer_group_size", "max_descriptor_bytes"), min=1)
        check_range(self, "whole_request_bytes", min=0)
