"""The TCP shard server under hostile clients and mistakes (csrc/server/tcp_server.h).

A slowloris attack (connections that send a byte of a Hello every 0.1 s, never finishing it)
and a connection flood (thousands of silent connections, reopened as the server sheds them)
run against a live server while a legitimate client is measured before, during and after:
it never sees an error, and its p99 latencies are printed. The server stays within its
bounds throughout: its threads are its loop threads, unauthenticated connections never
exceed their limits, and each is closed at its absolute handshake deadline.
"""

from __future__ import annotations

import socket
import time

import ps_wire as w
import pytest
from hostile_clients import Attack, LegitimateClient

from torchrec_bagpipe.ps import PSShard

TOKEN = "hardening-job-token"


def _phases(server: object, attack: Attack) -> dict[str, object]:
    legit = LegitimateClient(server.address, TOKEN)
    try:
        before = legit.measure(1.0)
        with attack:
            time.sleep(1.0)  # let the attack reach its full size
            during = legit.measure(3.0)
            stats_during = server.stats()
        after = legit.measure(1.0)
    finally:
        legit.close()
    for name, lat in (("before", before), ("during", during), ("after", after)):
        print(f"{name}: {lat.summary()}")
    return {"before": before, "during": during, "after": after, "stats": stats_during}


@pytest.mark.parametrize("sources", ["other hosts", "same host"])
@pytest.mark.parametrize("kind", ["slowloris", "flood"])
def test_a_legitimate_client_always_gets_in(kind: str, sources: str) -> None:
    """`other hosts`: the attackers connect from 127.0.0.2/3 (their own per-address budget);
    `same host`: from the legitimate client's own address, sharing its budget."""
    shard = PSShard()
    server = shard.serve(job_token=TOKEN, handshake_timeout=1.0, max_unauthenticated=64,
                         max_unauthenticated_per_host=16, io_threads=2)
    try:
        address = (server.host, server.port)
        src = ("127.0.0.2", "127.0.0.3") if sources == "other hosts" else ("127.0.0.1",)
        attack = (Attack(address, 300, trickle=True, interval=0.1, sources=src)
                  if kind == "slowloris"
                  else Attack(address, 2000, trickle=False, interval=0.05, sources=src))
        r = _phases(server, attack)
        for phase in ("before", "during", "after"):
            lat = r[phase]
            assert not lat.errors, f"{phase}: {lat.errors[:3]}"
            assert lat.round_trip and lat.new_client, phase
        st = r["stats"]
        print(f"server during the {kind}: {st}")
        assert st["threads"] == 2  # the loop threads, whatever the number of connections
        assert st["unauthenticated"] <= 64
        assert attack.opened > 300
        # The attackers were shed (newer ones arrived) or timed out (absolute deadline).
        assert st["shed"] + st["handshake_timeouts"] > 0
    finally:
        server.stop()
        shard.close()


def test_handshake_deadline_is_absolute() -> None:
    shard = PSShard()
    server = shard.serve(job_token=TOKEN, handshake_timeout=0.5)
    try:
        hello = w.hello(TOKEN)
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            closed = False
            for i in range(len(hello) - 1):  # a byte every 0.05 s: never a full Hello
                try:
                    s.sendall(hello[i:i + 1])
                except OSError:
                    closed = True
                    break
                time.sleep(0.05)
            # With a deadline per receive the server would keep a client that never stops
            # trickling; an absolute one closes it while it still sends.
            assert closed, "the server kept a trickling connection past its deadline"
        assert server.stats()["handshake_timeouts"] == 1
    finally:
        server.stop()


def test_idle_authenticated_connections_are_closed_but_live_clients_stay() -> None:
    from torchrec_bagpipe.ps.client import PSClient

    shard = PSShard()
    server = shard.serve(job_token=TOKEN, idle_timeout=1.0)
    try:
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            s.sendall(w.hello(TOKEN))
            s.settimeout(5)
            assert s.recv(w.HEADER.size)  # HelloOk
            # Silent from now on: closed after idle_timeout.
            t0 = time.monotonic()
            while s.recv(4096):
                pass
            assert 0.8 < time.monotonic() - t0 < 5
        assert server.stats()["idle_timeouts"] == 1
        # A client that keeps the connection alive (keep-alive Pings) survives idle periods.
        client = PSClient([server.address], table="t", dim=4, lr=0.5, init="zeros",
                          job_token=TOKEN, keepalive_interval=0.2)
        try:
            time.sleep(2.5)
            assert client.lookup(__import__("torch").tensor([1])).shape == (1, 4)
            assert server.stats()["idle_timeouts"] == 1
        finally:
            client.close()
    finally:
        server.stop()


def test_no_token_is_refused_off_loopback_unless_allowed() -> None:
    shard = PSShard()
    with pytest.raises(ValueError, match="without a job token"):
        shard.serve(host="0.0.0.0", port=0)
    server = shard.serve(host="127.0.0.1", port=0)  # loopback: fine without a token
    server.stop()
    server = shard.serve(host="0.0.0.0", port=0, allow_no_token=True)
    server.stop()
    shard.close()
