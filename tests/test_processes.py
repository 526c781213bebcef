"""Ports for local gloo rendezvous: a CI run lost one to a race (EADDRINUSE in the launcher's
rendezvous), so ports are drawn below the kernel's ephemeral range and the trainer harness retries
only that failure (the retry loop itself runs in every real-trainer test)."""
import socket

from megatron_slimpack.runtime.processes import _ephemeral_range_start, free_port
from tests.real_megatron.harness import _lost_its_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < _ephemeral_range_start() for port in ports)
    assert len(ports) > 1  # drawn, not one fixed port every test would fight over
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_the_harness_recognises_only_a_rendezvous_that_lost_its_port():
    lost = ('File ".../static_tcp_rendezvous.py", line 67, in next_rendezvous\n'
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
            "address. port: 46455, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    assert _lost_its_port(1, lost)
    assert not _lost_its_port(0, lost)
    assert not _lost_its_port(1, "AssertionError: loss differs\n_rendezvous ok")
