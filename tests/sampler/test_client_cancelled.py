"""A call the trainer cancels is the trainer's doing, not a stop we asked for.

A trainer shutting down cancels the calls in flight (gRPC's CANCELLED). The sampler once broke
out of its loop on any CANCELLED and exited 0 with its counts, as if it had been told to stop;
CI caught it in a shipped-config run whose external sampler's lease was in flight when the run
ended. Now the client retries a CANCELLED it did not cause (a trainer that stays away ends the
sampler as ``gone``, exit 1; one that comes back is rejoined), and a client closed by us still
gives up at once with CANCELLED. A real gRPC server on loopback plays the trainer.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from mixrl_wire import pb, pb_grpc
from sampler_torch.client import Backoff, RolloutClient, RolloutError


class CancellingTrainer(pb_grpc.RolloutServicer):
    """Registers anyone; cancels the first ``cancel`` leases and submits, then answers."""

    def __init__(self, cancel: int):
        self.cancel, self.leases, self.submits = cancel, 0, 0
        self.lock = threading.Lock()

    def Register(self, request, context):
        return pb.RegisterResponse(session_id="s1", server_id="trainer-a")

    def Lease(self, request, context):
        with self.lock:
            self.leases += 1
            if self.leases <= self.cancel:
                context.abort(grpc.StatusCode.CANCELLED, "server shutting down")
        return pb.LeaseResponse(retry_after_ms=100)

    def Submit(self, request, context):
        with self.lock:
            self.submits += 1
            if self.submits <= self.cancel:
                context.abort(grpc.StatusCode.CANCELLED, "server shutting down")
        return pb.SubmitAck(task_id=3, sample_index=1)


@pytest.fixture
def trainer():
    servicer = CancellingTrainer(cancel=2)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_RolloutServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=0)


def _client(address: str) -> RolloutClient:
    return RolloutClient(address, "tok", group="g", backoff=Backoff(initial_s=0.01, max_s=0.05),
                         max_retry_s=10.0)


def test_a_cancelled_lease_is_retried_while_the_client_is_open(trainer):
    servicer, address = trainer
    client = _client(address)
    try:
        resp = client.lease(4)
        assert resp.retry_after_ms == 100 and servicer.leases == 3  # two cancelled, the third answered
    finally:
        client.close()


def test_a_cancelled_submit_is_retried_and_lands(trainer):
    servicer, address = trainer
    client = _client(address)
    try:
        client.register()
        result = client.submit(pb.Trajectory(task_id=3, sample_index=1))
        assert result.accepted and servicer.submits == 3, result
    finally:
        client.close()


def test_a_closed_client_gives_up_with_cancelled_at_once(trainer):
    servicer, address = trainer
    client = _client(address)
    client.register()
    client.close()
    with pytest.raises(RolloutError) as e:
        client.lease(4)
    assert e.value.code == grpc.StatusCode.CANCELLED and servicer.leases == 0
