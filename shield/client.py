"""`PolicyClient`: the Python side of the serve protocol (docs/reference/protocol.md).

    client = PolicyClient("127.0.0.1", 9870, key=None)
    reply = client.act(obs)                      # active mode
    reply = client.act(obs, legacy_action=u)     # shadow mode
    reply = client.act(obs, new_episode=True)    # first step of an episode: a stateful policy starts afresh
    reply = client.act(obs, obs_missing=True)    # sensor dropout: the shield dead-reckons (obs gives the size)
    if reply.status & Status.BLIND_PAST_HORIZON: stop the plant (blind past the shield's blind horizon)
    if reply.ok: apply(reply.action)

Sequence numbers follow the wall clock: `seq = max(last + 1, now_us)`, which a
keyed server requires (within its clock window, above its start); each client
object has a random 32-bit client_id, which names its plant session on the
server. Replies whose sequence number or client_id does not match the request
(a late reply to an earlier, timed-out request; another plant's reply with the
same seq) are skipped; with a key, only replies signed with the reply-direction
key count, and the signature covers both.

A stateful policy's state lives on the server and has seen every action the
server answered. When this client got no usable reply to a request (none in
time, or a refusal: the plant applies its own fallback, which the state never
saw), its next act request carries Flags.RESET_STATE so that the state starts
afresh (docs/reference/contracts.md, "Policy state").
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from shield.protocol import (
    HEADER,
    MsgType,
    PacketError,
    PlantEstimate,
    Reply,
    ServedContract,
    ServerStatus,
    Status,
    decode_act_reply,
    decode_contract_reply,
    decode_estimate_reply,
    decode_status_reply,
    encode_act_request,
    encode_contract_request,
    encode_estimate_request,
    encode_status_request,
)

# Replies whose action the server's policy state never recorded: the next request resets that state.
UNRECORDED = Status.BAD_INPUT | Status.AUTH_FAILED | Status.STALE | Status.BUSY


class PolicyTimeout(TimeoutError):
    """No matching reply within the client's timeout."""


class ContractMismatch(RuntimeError):
    """The served bundle's I/O contract is not the one this controller was built for."""


class PolicyClient:
    """Blocking UDP client: one request, one reply."""

    def __init__(
        self, host: str, port: int, key: bytes | None = None, *, timeout_s: float = 1.0, busy_poll: bool = False
    ):
        """`busy_poll`: wait for replies by spinning (no wake-up latency, one CPU busy while waiting)."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 (seconds to wait for a reply), got {timeout_s!r}")
        self.address = (host, int(port))
        self.busy_poll = busy_poll
        self.key = key
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(self.address)  # connected: only the server's datagrams are received
        self.timeout_s = float(timeout_s)
        # Spinning needs a non-blocking socket: with a timeout set, Python polls for up to that long before
        # every recv (MSG_DONTWAIT or not) and raises its own TimeoutError.
        self.sock.settimeout(0.0 if busy_poll else self.timeout_s)
        self.seq = 0
        # With a key the server's replay window is per client_id: one random id per client object.
        self.client_id = int.from_bytes(os.urandom(4), "little")
        self.unrecorded = False  # the last act request got no reply the server's policy state recorded

    def next_seq(self) -> int:
        """A fresh sequence number: max(last + 1, wall clock in µs)."""
        self.seq = max(self.seq + 1, time.time_ns() // 1000)
        return self.seq

    def send_act(self, obs, legacy_action=None, reset_state: bool = False, obs_missing: bool = False) -> int:
        """Send an act request without waiting; returns its sequence number. `obs_missing`: Flags.OBS_MISSING,
        and NaN in place of `obs`'s values (it gives the observation's size only)."""
        seq = self.next_seq()
        if obs_missing:
            obs = np.full(np.size(obs), np.nan, np.float32)
        self.sock.send(
            encode_act_request(
                seq,
                time.monotonic_ns() // 1000,
                obs,
                legacy_action,
                self.key,
                self.client_id,
                reset_state,
                obs_missing,
            )
        )
        return seq

    def _recv(self, deadline: float) -> bytes:
        """The next datagram, or PolicyTimeout once `deadline` (time.monotonic) has passed."""
        if not self.busy_poll:
            # Wait only for what is left of the deadline: a stale datagram (a late reply to an earlier request)
            # must not restart the wait, or one request could block for up to twice `timeout_s`.
            left = deadline - time.monotonic()
            if left <= 0:
                raise PolicyTimeout(f"no reply from {self.address[0]}:{self.address[1]}")
            self.sock.settimeout(left)
            try:
                return self.sock.recv(65535)
            except TimeoutError:
                raise PolicyTimeout(f"no reply from {self.address[0]}:{self.address[1]}") from None
        while True:
            try:
                return self.sock.recv(65535)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PolicyTimeout(f"no reply from {self.address[0]}:{self.address[1]}") from None

    def recv_reply(self, seq: int) -> Reply:
        """Wait for the reply to request `seq`, skipping stale replies to earlier ones."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                data = self._recv(deadline)
            except PolicyTimeout:
                raise PolicyTimeout(f"no reply to seq {seq} from {self.address[0]}:{self.address[1]}") from None
            try:
                reply = decode_act_reply(data, self.key)
            except PacketError:
                reply = None  # unsigned/forged or not a reply: ignore it
            if reply is not None and reply.seq == seq and reply.client_id == self.client_id:
                return reply
            if time.monotonic() > deadline:
                raise PolicyTimeout(f"no reply to seq {seq} from {self.address[0]}:{self.address[1]}")

    def act(self, obs, legacy_action=None, *, new_episode: bool = False, obs_missing: bool = False) -> Reply:
        """Send one observation (float32[obs_dim]) and return the server's Reply (action, status, latency µs).

        `new_episode`: the policy's state starts afresh; it does as well after a request without a usable reply.
        `obs_missing`: this step's observation is missing (a sensor dropout); `obs` gives only its size. The
        shield dead-reckons and the reply carries Status.BLIND (and FALLBACK: the policy did not run), plus
        Status.BLIND_PAST_HORIZON once blind longer than the contract's `blind_horizon`: stop the plant then.
        """
        seq = self.send_act(obs, legacy_action, reset_state=new_episode or self.unrecorded, obs_missing=obs_missing)
        self.unrecorded = True
        reply = self.recv_reply(seq)
        self.unrecorded = bool(reply.status & UNRECORDED)
        return reply

    def status(self) -> ServerStatus:
        """Ask for the server's counters and latency histogram."""
        return self._ask(encode_status_request, MsgType.STATUS_REPLY, decode_status_reply, "status")

    def contract(self) -> ServedContract:
        """Ask what the served bundle expects: dimensions, control period, names hash, policy state."""
        return self._ask(encode_contract_request, MsgType.CONTRACT_REPLY, decode_contract_reply, "contract")

    def estimate(self) -> PlantEstimate:
        """Ask what the served policy believes about this controller's plant: the domain parameters it estimates
        (the contract's plant_estimate.parameters, in order; empty when it estimates none or has not seen this
        plant), and how many steps its state has seen since it last started."""
        return self._ask(encode_estimate_request, MsgType.ESTIMATE_REPLY, decode_estimate_reply, "estimate")

    def check_contract(self, names_sha256: str) -> ServedContract:
        """The served contract, or ContractMismatch when its names hash is not `names_sha256` (the one this
        controller was built for: the bundle's manifest `contract.names_sha256`)."""
        served = self.contract()
        if served.names_sha256 != names_sha256:
            raise ContractMismatch(
                f"{self.address[0]}:{self.address[1]} serves a bundle whose I/O contract hashes to "
                f"{served.names_sha256 or '(none: no contract)'}, this controller was built for {names_sha256}"
            )
        return served

    def _ask(self, encode, reply_type: MsgType, decode, what: str):
        seq = self.next_seq()
        self.sock.send(encode(seq, time.monotonic_ns() // 1000, self.key, self.client_id))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() <= deadline:
            try:
                data = self._recv(deadline)
            except PolicyTimeout:
                break
            if len(data) >= HEADER.size and data[5] == reply_type:
                try:
                    reply = decode(data, self.key)
                except PacketError:
                    continue
                if reply.seq == seq and reply.client_id == self.client_id:
                    return reply
        raise PolicyTimeout(f"no {what} reply from {self.address[0]}:{self.address[1]}")

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
