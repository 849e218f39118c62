"""Settings of the KV transfer layer, and the config-gated fault points tests use to reach each phase."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FaultAction = Literal["pause", "drop", "die"]
Role = Literal["sender", "receiver"]


@dataclass(frozen=True)
class FaultPoint:
    """Misbehave on purpose once a transfer has moved ``after_messages`` payload messages.

    - ``pause``: sleep ``seconds`` (a silent but live peer; the other side's deadline must fire);
    - ``drop``: abort the pair's group and control stream without a word (a broken connection);
    - ``die``: end the whole process at once (``os._exit``), as a crash or a lost node would.

    Counting is per transfer: the point fires in every transfer this endpoint moves whose id (a
    worker's transfer id is its request id) starts with ``request_id_prefix`` ("": every transfer),
    when that transfer's own count reaches ``after_messages``. So a long-lived deployment pauses each
    matching request, not only the first one it ever sees. The sender fires after posting that many
    of the transfer's messages and before posting the next (0: before the first), so a pause holds
    the rest of the transfer back and a transfer of ``after_messages`` messages or fewer is untouched;
    the receiver fires once that many have arrived.
    """

    role: Role
    action: FaultAction
    after_messages: int
    seconds: float = 0.0
    request_id_prefix: str = ""

    def __post_init__(self) -> None:
        if self.role not in ("sender", "receiver"):
            raise ValueError(f"fault.role: {self.role!r} is not 'sender' or 'receiver'")
        if self.action not in ("pause", "drop", "die"):
            raise ValueError(f"fault.action: {self.action!r} is not 'pause', 'drop' or 'die'")
        if self.after_messages < 0:
            raise ValueError(f"fault.after_messages: must be >= 0, got {self.after_messages}")
        if not self.seconds >= 0:
            raise ValueError(f"fault.seconds: must be >= 0, got {self.seconds}")
        if not isinstance(self.request_id_prefix, str):
            raise ValueError(f"fault.request_id_prefix: must be a string, got {self.request_id_prefix!r}")

    def fires(self, role: Role, transfer_id: str, messages_done: int) -> bool:
        """Whether this point fires for ``transfer_id`` once it has moved ``messages_done`` messages."""
        return (
            self.role == role
            and self.after_messages == messages_done
            and transfer_id.startswith(self.request_id_prefix)
        )


@dataclass(frozen=True)
class TransferConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: NCCL when the KV lives on CUDA, else gloo
    pair_setup_timeout_s: float = 10.0  # control stream + group rendezvous
    op_timeout_s: float = 5.0  # one payload send or receive
    transfer_timeout_s: float = 60.0  # a whole transfer, from start/expect to done
    max_pairs: int = 64  # groups kept per endpoint; least recently used idle pairs are closed beyond it
    max_message_bytes: int = 8 << 20  # payload messages are packed up to this size
    whole_request_bytes: int = 4 << 20  # below this a request goes in one message, not by layer group
    layer_group_size: int = 4  # layers per streamed group
    max_descriptor_bytes: int = 64 << 10
    faults: tuple[FaultPoint, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend: {self.backend!r} is not 'auto', 'gloo' or 'nccl'")
        for name in ("pair_setup_timeout_s", "op_timeout_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_pairs", "max_message_bytes", "layer_group_size", "max_descriptor_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.whole_request_bytes < 0:
            raise ValueError(f"whole_request_bytes: must be >= 0, got {self.whole_request_bytes}")

    def fault(self, role: Role, transfer_id: str, messages_done: int) -> FaultPoint | None:
        """The fault point that fires for this transfer after its ``messages_done``-th message, if any."""
        return next((f for f in self.faults if f.fires(role, transfer_id, messages_done)), None)
