"""The transport under prefill/decode disaggregation's KV connector: how K/V blocks and the
messages about them travel between two engine processes, over ``torch.distributed``
point-to-point messages. The protocol (what is asked for, held, released; when a transfer is
done or failed) is :mod:`course_lib.engine.p2p_connector`'s; this module only moves what it is
given, with two operations:

* **decode side,** :meth:`P2PTransport.read`: send a *read request* to a prefill engine
  (``[request id, tag, first block, number of blocks]``, one ``int64`` tensor), receive its
  answer (``[status, number of layers]``), then that many layer messages into the buffers
  given (per layer, K and V of the blocks: ``[2, n, block_size, kv_heads, head_dim]``), then
  the trailer (``[1]``: the layers are good);
* **prefill side,** :meth:`P2PTransport.read_requests` (the read requests that came in) and
  :meth:`P2PTransport.answer`: send a status, then one message per layer, then the trailer.

Each returns a :class:`Transfer` at once; a thread does the blocking calls, and the engine's
thread only looks at ``Transfer.done`` later. vLLM 0.33.0's NIXL connector has a transport
of this shape inside it (in ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``:
``base_worker.py``'s ``NixlBaseConnectorWorker`` with its NIXL agent and its handshake over
a ZMQ side channel, ``_nixl_handshake``; ``pull_worker.py``'s ``_read_blocks``), with one
difference: NIXL's decode side *reads* the prefill side's GPU memory (RDMA, one-sided) and
notifies it when done; ``torch.distributed`` has no one-sided read, so the decode side asks
and the prefill side sends. The blocks are gathered into one contiguous buffer per layer
before the send (a send needs contiguous memory; NIXL reads the blocks in place).

**Messages on threads.** A gloo send or receive blocks, and its ``is_completed()`` does not
move before ``wait()``: each peer gets a :class:`_PeerThread` that does the blocking calls in
order, and on the prefill side one more thread per peer listens for its read requests
(:meth:`P2PTransport._listen`). The connector calls :meth:`P2PTransport.read` and
:meth:`P2PTransport.answer` between steps, never inside one.

**Where the bytes travel.** The read requests and statuses are small ``int64`` CPU tensors on
the world group (gloo), as the caller set it up. The layer messages go on ``data_groups``:
peer rank -> a group of this engine and that peer alone (``dist.new_group([p, d])``, made by
:mod:`course_lib.parallel.disagg`; ``None``: the world group). With ``data_backend="gloo"`` the
layers are staged through CPU memory (:meth:`P2PTransport.staging_device` is the CPU: the
connector gathers the blocks there and copies them back to the cache's device), since gloo
moves CPU tensors; with ``"nccl"`` the buffers stay on the cache's GPU and NCCL moves them GPU
to GPU. Why a group per pair: NCCL point-to-point ignores ``tag`` (messages on a communicator
match in the order they are posted) and one communicator must not be driven from two threads.
Both hold here:

* one thread per process touches a pair's group: the peer thread of that peer (prefill side:
  :meth:`P2PTransport._send_work`; decode side: :meth:`P2PTransport._read_work`); the listener
  uses the world group only;
* at most one transfer is outstanding per pair: the decode side's peer thread does a read's
  request, status and every layer before it takes the next read from its queue, so the next
  read request leaves only once the last layer arrived; the prefill side answers on its peer
  thread only in answer to a read request, whole (status, then the layers in order). So the
  layer messages of a pair are posted in the same order on both sides, and order alone
  matches them (the tags stay, for gloo).

A receive that returns on the CPU does not mean NCCL's data arrived (it is queued on a CUDA
stream): after the last layer the decode side's thread synchronizes its CUDA stream before the
transfer is marked done, and the prefill side's after its last send
(:meth:`P2PTransport._wait_for_device`; a no-op for CPU buffers). A dead peer makes NCCL wait
rather than fail: the pair groups have a short timeout
(``course_lib.parallel.disagg.PAIR_TIMEOUT_S``; they are used only once the gloo status has
shown the peer alive), and the engine processes run with ``TORCH_NCCL_BLOCKING_WAIT=1`` and
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` (the names torch 2.13's ``libtorch_cpu.so`` holds; in
torch's ``ProcessGroupNCCL.cpp``, blocking wait makes ``wait()`` poll on the CPU, abort the
communicator and raise in the calling thread once the timeout passed, and starts no watchdog
that would tear the process down): the timeout is a failed transfer. **The NCCL path is
unverified here**: this course's machine has no GPU; the tests that run it
(``tests/test_disagg.py``) skip without one. Also untried: an engine with several peers drives
several NCCL communicators at once, one per thread (NCCL's user guide, "Using multiple NCCL
communicators concurrently", warns this can deadlock when their operations are not ordered);
it would show as the timeout above.

**Failures.** A peer process that dies makes its pending messages fail (gloo: "connection
closed by peer"; NCCL: the pair group's timeout): the transfer under way gets its ``error``,
and the peer is marked dead, so every later transfer to it fails at once. A layer the prefill
side fails to send while the pair itself still works (a send that raises once) fails that
transfer only: the peer waits for every layer it was told of, so the prefill side sends it
zeros in place of the failed layer and the ones after, then the transfer's last message, its
*trailer*, says whether the layers are good (``[1]``) or not (``[0]``); the decode side
throws a bad transfer away, and the next transfer on the pair goes through as usual. (A send
that fails again while filling in means the pair is broken: the peer is marked dead.) What a
failure means for the blocks is the connector's to say. How long anyone waits for a peer that
stops answering without dying is bounded above this module: the connector gives up on a
transfer after its ``transfer_timeout_s``, and :mod:`course_lib.parallel.disagg`'s proxy kills
an engine that stopped answering (its lease), which closes its connections and fails every
message still waiting on it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

CTRL_TAG = 1            # read requests, decode -> prefill, in order per pair
DATA_BACKENDS = ("gloo", "nccl")


@dataclass
class ReadRequest:
    """A read request as the prefill side received it: from ``peer``, for ``num_blocks``
    blocks of request ``request_id`` from its block ``first_block``; ``tag``: the one its
    answer must carry."""

    peer: int
    request_id: int
    tag: int
    first_block: int
    num_blocks: int


@dataclass
class Transfer:
    """One read (decode side) or answer (prefill side) on a peer's thread. ``buffers``: per
    layer ``[2, n, block_size, kv_heads, head_dim]``, received into or sent from. ``status``:
    the answer's status word (its meaning is the connector's). The thread sets ``done`` last,
    after ``error`` (``None``: it went through)."""

    peer: int
    tag: int
    request_id: int
    first_block: int = 0
    num_blocks: int = 0
    buffers: list[torch.Tensor] = field(default_factory=list)
    status: int = 0
    done: bool = False
    error: str | None = None
    started: float = field(default_factory=time.monotonic)    # when it was asked for


class _PeerThread:
    """A daemon thread doing one peer's blocking sends and receives, in order."""

    def __init__(self, name: str, work: Callable[[Transfer], None]) -> None:
        self.queue: deque[Transfer | None] = deque()
        self.ready = threading.Condition()
        self.dead: str | None = None
        self._work = work
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, t: Transfer | None) -> None:
        """Queue a transfer (``None``: stop once the ones before it are done)."""
        with self.ready:
            self.queue.append(t)
            self.ready.notify()

    def _run(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                t = self.queue.popleft()
            if t is None:
                return
            if self.dead is not None:               # the peer is gone: fail at once
                t.error, t.done = self.dead, True
                continue
            try:
                self._work(t)
            except Exception as exc:                 # a dead peer: connection closed
                self.dead = t.error = f"{type(exc).__name__}: {exc}"
            t.done = True


class P2PTransport:
    """Messages between this engine (rank ``rank`` of the ``torch.distributed`` world of all
    engines, initialised by the caller, as :mod:`course_lib.parallel.disagg` does) and its
    peers (module docstring). ``comm``: what moves the messages, with ``torch.distributed``'s
    ``send``, ``recv``, ``all_gather_object`` and ``get_world_size``: that module itself by
    default; the tests pass an in-process stand-in to drive two engines in one process.
    ``data_groups``: peer rank -> the group its layer messages go on (``group=`` of ``send`` /
    ``recv``); None: the world group. ``data_backend``: ``"gloo"`` (layers staged through CPU
    memory) or ``"nccl"`` (layers stay on the cache's GPU). ``exit_after_layers``: fault
    injection for the tests and chapter 13: the process exits (``os._exit``) once a transfer
    has sent or received that many layers: a process killed mid-transfer.
    ``fail_layer_send``: fault injection too: the ``n``-th layer message this engine sends
    (counted from 1 over all its transfers) raises once, before anything is posted: one failed
    send on a pair that works (module docstring, *Failures*)."""

    def __init__(self, rank: int, *, comm: Any = dist, data_groups: dict[int, Any] | None = None,
                 data_backend: str = "gloo", exit_after_layers: int | None = None,
                 fail_layer_send: int | None = None) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        if data_backend not in DATA_BACKENDS:
            raise ValueError(f"data_backend must be one of {DATA_BACKENDS}, got "
                             f"{data_backend!r}")
        if exit_after_layers is not None and (isinstance(exit_after_layers, bool) or not
                                              isinstance(exit_after_layers, int)
                                              or exit_after_layers < 1):
            raise ValueError(f"exit_after_layers must be None or an int >= 1, got "
                             f"{exit_after_layers!r}")
        if fail_layer_send is not None and (isinstance(fail_layer_send, bool) or not
                                            isinstance(fail_layer_send, int)
                                            or fail_layer_send < 1):
            raise ValueError(f"fail_layer_send must be None or an int >= 1, got "
                             f"{fail_layer_send!r}")
        self.rank = rank
        self.comm = comm
        self.data_groups = data_groups
        self.data_backend = data_backend
        self.exit_after_layers = exit_after_layers
        self.fail_layer_send = fail_layer_send
        self._layers_sent = 0                        # layer messages posted, for the fault
        #: layer messages sent or received, per group: "pair <p>-<d>" or "world"
        self.layer_messages: dict[str, int] = {}
        self._peers: dict[int, _PeerThread] = {}
        self._inbox: list[ReadRequest] = []          # prefill: read requests not taken yet
        self._lock = threading.Lock()                # the inbox and the counts (threads')
        self._next_tag = CTRL_TAG + 1

    # --------------------------------------------------------------- meeting the peers
    def world_size(self) -> int:
        return self.comm.get_world_size()

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank (one collective over the world)."""
        gathered: list[Any] = [None] * self.world_size()
        self.comm.all_gather_object(gathered, obj)
        return gathered

    def start(self, peers: list[int], *, serve: bool, cache_device: torch.device) -> None:
        """Start a thread per peer; ``serve`` (the prefill side): also one that listens for
        each peer's read requests. ``ValueError``, before any thread starts, if
        ``data_groups`` does not name exactly ``peers`` or NCCL is asked for a cache that is
        not on a GPU."""
        if self.data_groups is not None and set(self.data_groups) != set(peers):
            raise ValueError(f"data_groups must name each peer of the other role "
                             f"({sorted(peers)}), got {sorted(self.data_groups)}")
        if self.data_backend == "nccl" and cache_device.type != "cuda":
            raise ValueError(f"data_backend='nccl' moves GPU memory; this engine's KV cache "
                             f"is on {cache_device} (use 'gloo')")
        side = "kv_producer" if serve else "kv_consumer"
        for peer in peers:
            work = self._send_work if serve else self._read_work
            self._peers[peer] = _PeerThread(f"kv-{side}-peer{peer}", work)
            if serve:
                threading.Thread(target=self._listen, args=(peer,), daemon=True,
                                 name=f"kv-listen-{peer}").start()

    def staging_device(self, cache_device: torch.device) -> torch.device:
        """Where the layer messages' buffers live: the cache's device for NCCL, else the CPU
        (gloo moves CPU tensors: the layers are staged through CPU memory)."""
        return cache_device if self.data_backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Stop the peers' threads once their queued transfers are done (a process that ends
        need not call it; an engine dropped inside a process that goes on should). A listener
        stops when ``comm.recv`` raises."""
        for peer in self._peers.values():
            peer.submit(None)

    # --------------------------------------------------------------- the two operations
    def read(self, peer: int, request_id: int, first_block: int, num_blocks: int,
             buffers: list[torch.Tensor]) -> Transfer:
        """Decode side: ask ``peer`` for ``num_blocks`` blocks of its request ``request_id``
        from ``first_block``, to be received into ``buffers`` (one per layer; none when
        ``num_blocks`` is 0). Returns at once; the peer's thread does it."""
        t = Transfer(peer, self._next_tag, request_id, first_block, num_blocks, buffers)
        self._next_tag += 2 + len(buffers)   # the answer's tag, one per layer, the trailer's
        thread = self._peers.get(peer)
        if thread is None:
            t.error, t.done = f"rank {peer} is not a peer of rank {self.rank}", True
        else:
            thread.submit(t)
        return t

    def read_requests(self) -> list[ReadRequest]:
        """Prefill side: the read requests received since the last call, in order."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        return inbox

    def answer(self, request: ReadRequest, status: int, buffers: list[torch.Tensor]
               ) -> Transfer:
        """Prefill side: answer ``request`` with ``status``, then one message per layer of
        ``buffers`` (none: a status alone). Returns at once; the peer's thread does it."""
        t = Transfer(request.peer, request.tag, request.request_id, request.first_block,
                     request.num_blocks, buffers, status)
        self._peers[request.peer].submit(t)
        return t

    # ---------------------------------------------------------------------- the threads
    def _listen(self, peer: int) -> None:
        """Prefill side: receive read requests from one decode engine, forever."""
        msg = torch.zeros(4, dtype=torch.int64)
        while True:
            try:
                self.comm.recv(msg, src=peer, tag=CTRL_TAG)
            except Exception as exc:                  # the peer is gone
                self._peers[peer].dead = f"{type(exc).__name__}: {exc}"
                return
            with self._lock:
                self._inbox.append(ReadRequest(peer, *msg.tolist()))

    def _send_work(self, t: Transfer) -> None:
        """Prefill side, on the peer's thread: the status (world group), one message per layer
        (the pair's group), the trailer (world group), then the GPU's work waited for. A layer
        whose send raises is replaced, with the ones after it, by zeros, and the trailer says
        so: that transfer fails (``t.error``), the pair goes on (module docstring)."""
        group, name = self._data_group(t.peer)
        self.comm.send(torch.tensor([t.status, len(t.buffers)], dtype=torch.int64),
                       t.peer, tag=t.tag)
        for layer, buf in enumerate(t.buffers):
            if t.error is None:
                try:
                    self._send_layer(buf, t.peer, t.tag + 1 + layer, group)
                except Exception as exc:
                    t.error = f"layer {layer} not sent: {type(exc).__name__}: {exc}"
            if t.error is not None:           # the peer waits for this layer: fill it in
                self.comm.send(torch.zeros_like(buf), t.peer, tag=t.tag + 1 + layer,
                               group=group)
            self._count_layer(name)
            self._maybe_exit(layer + 1)
        if t.buffers:
            self.comm.send(torch.tensor([int(t.error is None)], dtype=torch.int64), t.peer,
                           tag=t.tag + 1 + len(t.buffers))
        self._wait_for_device(t.buffers)

    def _send_layer(self, buf: torch.Tensor, peer: int, tag: int, group: Any) -> None:
        self._layers_sent += 1
        if self._layers_sent == self.fail_layer_send:     # fault injection: fails once
            raise RuntimeError(f"injected failure of layer message {self._layers_sent}")
        self.comm.send(buf, peer, tag=tag, group=group)

    def _read_work(self, t: Transfer) -> None:
        """Decode side, on the peer's thread: the read request and the answer's status (world
        group), the layers (the pair's group), the trailer (world group), then the GPU's work
        waited for: only then is the transfer done (``_PeerThread`` sets ``done`` when this
        returns). A trailer that says the layers are bad fails this transfer alone."""
        group, name = self._data_group(t.peer)
        self.comm.send(torch.tensor([t.request_id, t.tag, t.first_block, t.num_blocks],
                                    dtype=torch.int64), t.peer, tag=CTRL_TAG)
        reply = torch.zeros(2, dtype=torch.int64)
        self.comm.recv(reply, src=t.peer, tag=t.tag)
        t.status, num_layers = int(reply[0]), int(reply[1])
        if num_layers not in (0, len(t.buffers)):
            raise RuntimeError(f"rank {t.peer} answers with {num_layers} layers, "
                               f"{len(t.buffers)} expected")
        for layer, buf in enumerate(t.buffers[:num_layers]):
            self.comm.recv(buf, src=t.peer, tag=t.tag + 1 + layer, group=group)
            self._count_layer(name)
            self._maybe_exit(layer + 1)
        if num_layers:
            good = torch.zeros(1, dtype=torch.int64)
            self.comm.recv(good, src=t.peer, tag=t.tag + 1 + num_layers)
            if not good.item():
                t.error = f"rank {t.peer} failed to send the layers"
        self._wait_for_device(t.buffers)

    def _data_group(self, peer: int) -> tuple[Any, str]:
        """The group of the layer messages with ``peer`` (None: the world group), and its
        name in :attr:`layer_messages`."""
        if self.data_groups is None:
            return None, "world"
        a, b = sorted((self.rank, peer))
        return self.data_groups[peer], f"pair {a}-{b}"

    def _count_layer(self, name: str) -> None:
        with self._lock:
            self.layer_messages[name] = self.layer_messages.get(name, 0) + 1

    def _maybe_exit(self, layers_done: int) -> None:
        if self.exit_after_layers is not None and layers_done >= self.exit_after_layers:
            os._exit(3)                                   # fault injection: killed mid-transfer

    @staticmethod
    def _wait_for_device(buffers: list[torch.Tensor]) -> None:
        """Block until the GPU has done the messages queued on these buffers. NCCL's send and
        receive return once queued on a CUDA stream (and ``wait()`` makes the current stream
        wait, not the CPU); nothing to do for CPU buffers, whose gloo messages are done when
        the call returns."""
        if buffers and buffers[0].is_cuda:
            torch.cuda.current_stream(buffers[0].device).synchronize()
