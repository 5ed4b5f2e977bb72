"""The `torchrec-bagpipe-ps` program: CLI, signals, logging, and robustness against hostile
input (a native fuzz driver sends >= 100k random and mutated frames to a live server; over
rdma, malformed UCX bootstraps and invalid frames written into the slot ring)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ps_transports import address, params, server_args

from torchrec_bagpipe import TransportError
from torchrec_bagpipe.ps import PSClient, spawn_server
from torchrec_bagpipe.testing import _C_testing as tools

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "torchrec_bagpipe.ps.server", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_help_documents_every_option() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for flag in ("--shard-id", "--num-shards", "--host", "--port", "--job-token", "--dim",
                 "--memory-budget", "--spill-dir", "--store-threads", "--checkpoint-dir",
                 "--checkpoint-every", "--restore", "--drain-timeout", "BAGPIPE_JOB_TOKEN",
                 "SIGTERM", "--transport", "--ucx-tls", "--ucx-devices"):
        assert flag in out.stdout, flag


def test_bad_arguments_exit_2_with_a_message() -> None:
    out = run_cli("--shard-id", "3", "--num-shards", "2")
    assert out.returncode == 2
    assert "shard_id 3 must be below num_shards 2" in out.stderr
    out = run_cli("--memory-budget", "lots")
    assert out.returncode == 2 and "memory_budget" in out.stderr


def test_sigterm_drains_checkpoints_and_exits_0(tmp_path: Path) -> None:
    log = tmp_path / "shard.log"
    with open(log, "w") as err:
        server = spawn_server(0, 1, job_token="tok", stderr=err,
                              args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--dim", "4"])
        with server:
            with PSClient([server.address], table="t", dim=4, lr=1.0, init="zeros",
                          job_token="tok") as c:
                c.commit(0, torch.tensor([1]), torch.ones(1, 4))
                with pytest.raises(ValueError, match="--dim 4"):
                    PSClient([server.address], table="u", dim=8, lr=1.0, init="zeros",
                             job_token="tok")
            assert server.terminate(60) == 0
    text = log.read_text()
    for line in ("listening on 127.0.0.1:", "session", "rank 0/1 opened", "rank 0 closed",
                 "SIGTERM: draining", "checkpointed 't' at step 0", "stopped"):
        assert line in text, (line, text)
    assert (tmp_path / "ckpt" / "table-t" / "MANIFEST").exists()


@pytest.fixture
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport of this run; rdma-* set UCX_TLS, which the server process inherits."""
    if request.param.startswith("rdma-"):
        monkeypatch.setenv("UCX_TLS", request.param.split("-", 1)[1])
    return str(request.param)


def fuzz(server: object, transport: str, token: str) -> dict:
    """Fuzzes `server`: over tcp 100k frames; over rdma (each closing violation costs a UCX
    connection set-up) 1000 malformed bootstraps and 4000 frames written into the slot ring.
    Returns frames, accepted, timeouts, rejected (error replies + connections closed on a
    frame) and connections."""
    if not transport.startswith("rdma"):
        st = tools.fuzz_server(server.host, server.port, token, 100_000, 1234)
        return {"frames": st["frames"], "accepted": st["accepted"],
                "first_accepted": st["first_accepted"], "timeouts": st["timeouts"],
                "rejected": st["error_replies"] + st["closed_by_server"],
                "connections": st["connections"], "want_frames": 100_000}
    st = tools.fuzz_ucx_server(server.host, server.port, token, 1000, 4000, 1234)
    assert st["bootstraps_refused"] == st["bootstraps"] == 1000
    return {"frames": st["frames"], "accepted": st["accepted"],
            "first_accepted": st["first_accepted"], "timeouts": st["timeouts"],
            "rejected": st["error_replies"] + st["closed_by_server"],
            "connections": st["connections"], "want_frames": 4000}


@pytest.mark.slow
@pytest.mark.parametrize("transport", params("tcp"), indirect=True)
def test_fuzzed_frames_are_all_rejected_and_the_server_keeps_serving(tmp_path: Path,
                                                                     transport: str) -> None:
    with open(tmp_path / "shard.log", "w") as err:
        server = spawn_server(0, 1, job_token="fuzz-token", stderr=err,
                              args=server_args(transport))
        with server:
            stats = fuzz(server, transport, "fuzz-token")
            frames = stats["want_frames"]
            assert stats["frames"] >= frames
            assert stats["accepted"] == 0, stats["first_accepted"]
            assert stats["timeouts"] == 0
            # Every frame was rejected: an error reply, or the connection closed on it.
            assert stats["rejected"] >= frames
            # header-level violations close connections
            assert stats["connections"] > frames // 100
            assert server.poll() is None  # alive
            # A well-formed client is still served.
            with PSClient([address(server, transport)], table="t", dim=4, lr=1.0, init="zeros",
                          job_token="fuzz-token") as c:
                c.commit(0, torch.tensor([1, 2]), torch.ones(2, 4))
                assert torch.equal(c.lookup(torch.tensor([1])), -torch.ones(1, 4))
            with pytest.raises(TransportError, match="job token"):
                PSClient([address(server, transport)], table="t", dim=4, lr=1.0, init="zeros",
                         job_token="stranger")
            assert server.terminate(60) == 0
