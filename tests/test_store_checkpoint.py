"""EmbeddingStore checkpoints: round trip, overrides, crash safety, refusal of bad ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from store_reference import rewrite_manifest

from torchrec_bagpipe.ps import EmbeddingStore, OptimizerSpec

REPO = Path(__file__).resolve().parents[1]
INIT = {"init": "uniform", "init_bound": 0.05, "seed": 3}


def _filled(n: int = 3000, dim: int = 8, **kw: object) -> EmbeddingStore:
    s = EmbeddingStore(dim=dim, **INIT, **kw)
    g = torch.Generator().manual_seed(1)
    k = torch.randint(-(2**40), 2**40, (n,), generator=g)
    s.apply_sgd(k, torch.randn(n, dim, generator=g), 0.3, 2)
    return s


def _snapshot(s: EmbeddingStore) -> dict[int, bytes]:
    out = {}
    for k, r in s.export(chunk_rows=1000):
        for key, row in zip(k.tolist(), r.numpy()):
            out[key] = row.tobytes()
    return out


def test_round_trip_with_meta_and_layout_overrides(tmp_path: Path) -> None:
    s = _filled(num_shards=8)
    s.save(tmp_path / "ck", meta={"committed_step": "41", "job": 'ü\n"quoted"'})
    info = EmbeddingStore.checkpoint_info(tmp_path / "ck")
    assert info["rows"] == len(s) and info["dim"] == 8 and info["version"] == 3
    assert info["optimizer"] == "sgd" and info["state_dim"] == 0
    assert info["meta"] == {"committed_step": "41", "job": 'ü\n"quoted"'}
    for overrides in ({}, {"num_shards": 1, "num_threads": 2}, {"num_shards": 64, "page_rows": 16}):
        t = EmbeddingStore.load(tmp_path / "ck", **overrides)
        assert t.meta == info["meta"]
        assert _snapshot(t) == _snapshot(s)
        # Unwritten keys still read as the same initial values.
        probe = torch.arange(100)
        assert torch.equal(
            t.lookup(probe, insert_missing=False), s.lookup(probe, insert_missing=False)
        )


def test_save_replaces_previous_checkpoint_and_empty_store(tmp_path: Path) -> None:
    s = EmbeddingStore(dim=4, **INIT)
    s.save(tmp_path / "ck")
    assert len(EmbeddingStore.load(tmp_path / "ck")) == 0
    s.assign(torch.tensor([1, 2]), torch.ones(2, 4))
    s.save(tmp_path / "ck", meta={"v": "2"})
    t = EmbeddingStore.load(tmp_path / "ck")
    assert t.meta == {"v": "2"} and len(t) == 2
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp directory left behind


def test_weights_only_export_loads_for_inference(tmp_path: Path) -> None:
    s = _filled()
    s.save(tmp_path / "w", weights_only=True)
    assert EmbeddingStore.checkpoint_info(tmp_path / "w")["contents"] == "weights"
    t = EmbeddingStore.load(tmp_path / "w", weights_only=True)
    assert _snapshot(t) == _snapshot(s)


def test_load_with_spill_budget(tmp_path: Path) -> None:
    s = _filled(n=4000, dim=16)
    s.save(tmp_path / "ck")
    with pytest.warns(UserWarning, match="spill"):
        t = EmbeddingStore.load(
            tmp_path / "ck", memory_budget=64 * 1024, spill_dir=tmp_path / "spill", page_rows=64
        )
    st = t.stats()
    assert st["pages_spilled"] > 0
    assert st["bytes_resident"] - st["bytes_maps"] <= 64 * 1024
    assert _snapshot(t) == _snapshot(s)


def test_mismatched_expectations_are_refused(tmp_path: Path) -> None:
    s = _filled()
    s.save(tmp_path / "ck")
    for kwargs, field in (
        ({"dim": 9}, "dim"),
        ({"init": "zeros"}, "init"),
        ({"seed": 4}, "seed"),
        ({"init_bound": 0.06}, "init_bound"),
    ):
        with pytest.raises(ValueError, match=field):
            EmbeddingStore.load(tmp_path / "ck", **kwargs)
    t = EmbeddingStore.load(tmp_path / "ck", dim=8, init="uniform", seed=3, init_bound=0.05)
    assert len(t) == len(s)
    with pytest.raises(ValueError, match="key_bound"):
        EmbeddingStore.load(tmp_path / "ck", key_bound=10)  # stored keys fall outside


def _checkpoint(tmp_path: Path) -> Path:
    s = _filled()
    s.save(tmp_path / "ck")
    return tmp_path / "ck"


def test_truncated_data_file_is_refused(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path)
    f = ck / "rows-0003.bin"
    f.write_bytes(f.read_bytes()[:-4])
    with pytest.raises(ValueError, match="torn"):
        EmbeddingStore.load(ck)


def test_flipped_byte_is_refused(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path)
    f = ck / "rows-0005.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        EmbeddingStore.load(ck)


def test_missing_or_torn_manifest_is_refused(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path)
    text = (ck / "MANIFEST").read_bytes()
    (ck / "MANIFEST").write_bytes(text[: len(text) // 2])
    with pytest.raises(ValueError, match="torn or corrupt"):
        EmbeddingStore.load(ck)
    (ck / "MANIFEST").unlink()
    with pytest.raises(ValueError, match="no MANIFEST"):
        EmbeddingStore.load(ck)
    with pytest.raises(ValueError, match="not a checkpoint"):
        EmbeddingStore.load(tmp_path / "nowhere")


def test_missing_data_file_is_refused(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path)
    (ck / "keys-0000.bin").unlink()
    with pytest.raises(ValueError, match="missing"):
        EmbeddingStore.load(ck)


def test_unknown_version_and_bad_fields_are_refused(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path)
    rewrite_manifest(str(ck / "MANIFEST"), lambda t: t.replace('"version": 3', '"version": 4'))
    with pytest.raises(ValueError, match="unknown checkpoint version 4"):
        EmbeddingStore.load(ck)
    ck2 = _checkpoint(tmp_path / "b")
    rewrite_manifest(str(ck2 / "MANIFEST"), lambda t: t.replace('\n  "rows": ', '\n  "rows": 1'))
    with pytest.raises(ValueError, match="rows"):
        EmbeddingStore.load(ck2)
    ck3 = _checkpoint(tmp_path / "c")
    rewrite_manifest(
        str(ck3 / "MANIFEST"), lambda t: t.replace('"file": "keys-0001.bin"', '"file": "../x"')
    )
    with pytest.raises(ValueError, match="plain file name"):
        EmbeddingStore.load(ck3)
    ck4 = _checkpoint(tmp_path / "d")
    rewrite_manifest(
        str(ck4 / "MANIFEST"),
        lambda t: t.replace('"format": "torchrec_bagpipe', '"format": "other'),
    )
    with pytest.raises(ValueError, match="not an EmbeddingStore checkpoint"):
        EmbeddingStore.load(ck4)


ADAM = OptimizerSpec("adam", eps=1e-6, beta1=0.8, beta2=0.99, weight_decay=0.01)


def _trained(spec: OptimizerSpec | str, n: int = 3000, dim: int = 8) -> EmbeddingStore:
    s = EmbeddingStore(dim=dim, **INIT, optimizer=spec)
    g = torch.Generator().manual_seed(2)
    for step in range(1, 4):
        k = torch.randint(-(2**40), 2**40, (n,), generator=g)
        s.apply_gradients(k, torch.randn(n, dim, generator=g), 0.01 * step, 2)
    return s


def _snapshot_with_state(s: EmbeddingStore) -> dict[int, tuple[bytes, bytes]]:
    out = {}
    for k, r, st in s.export(chunk_rows=1000, with_state=True):
        for key, row, state in zip(k.tolist(), r.numpy(), st.numpy()):
            out[key] = (row.tobytes(), state.tobytes())
    return out


@pytest.mark.parametrize("spec", ["adagrad", "rowwise_adagrad", ADAM])
def test_optimizer_state_round_trips(tmp_path: Path, spec: OptimizerSpec | str) -> None:
    s = _trained(spec)
    s.save(tmp_path / "ck", meta={"step": "3"})
    info = EmbeddingStore.checkpoint_info(tmp_path / "ck")
    assert info["optimizer_spec"] == s.optimizer and info["optimizer"] == s.optimizer.kind
    assert info["state_dim"] == s.state_dim > 0 and info["contents"] == "full"
    assert len(list((tmp_path / "ck").glob("state-*.bin"))) == info["num_shards"]
    for kwargs in ({}, {"optimizer": spec, "num_shards": 2, "num_threads": 2}):
        t = EmbeddingStore.load(tmp_path / "ck", **kwargs)
        assert t.optimizer == s.optimizer and t.state_dim == s.state_dim
        assert _snapshot_with_state(t) == _snapshot_with_state(s)
        # Unwritten keys read as the initial row and state in both.
        probe = torch.arange(50)
        a = t.lookup_with_state(probe, insert_missing=False)
        b = s.lookup_with_state(probe, insert_missing=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_weights_only_checkpoints_and_loads_start_from_the_initial_state(tmp_path: Path) -> None:
    s = _trained(ADAM)
    weights = {k: v[0] for k, v in _snapshot_with_state(s).items()}
    s.save(tmp_path / "w", weights_only=True)
    info = EmbeddingStore.checkpoint_info(tmp_path / "w")
    assert info["contents"] == "weights" and info["optimizer_spec"] == ADAM
    assert not list((tmp_path / "w").glob("state-*.bin"))
    # Its own optimizer, or another one: weights kept, every state initial.
    rowwise = OptimizerSpec("rowwise_adagrad", initial_accumulator_value=0.5)
    for kwargs, want in (({}, ADAM), ({"optimizer": rowwise}, rowwise)):
        t = EmbeddingStore.load(tmp_path / "w", **kwargs)
        assert t.optimizer == want
        init = EmbeddingStore.initial_state(1, 8, want)[0].numpy().tobytes()
        snap = _snapshot_with_state(t)
        assert {k: v[0] for k, v in snap.items()} == weights
        assert all(v[1] == init for v in snap.values())
    # A full checkpoint loaded weights_only may change the optimizer too.
    s.save(tmp_path / "full")
    t = EmbeddingStore.load(tmp_path / "full", weights_only=True, optimizer="adagrad")
    assert t.optimizer.kind == "adagrad"
    snap = _snapshot_with_state(t)
    assert {k: v[0] for k, v in snap.items()} == weights
    assert all(v[1] == bytes(4 * 8) for v in snap.values())


def test_version_1_sgd_checkpoints_still_load(tmp_path: Path) -> None:
    s = _filled()
    s.save(tmp_path / "ck")

    def to_v1(text: str) -> str:
        text = text.replace('"version": 3', '"version": 1')
        text = text[: text.index(',\n  "chain": ')] + "\n}\n"  # chains came with version 3
        at = text.index(', "eps_bits"')
        return text[:at] + text[text.index("}", at) :]

    rewrite_manifest(str(tmp_path / "ck" / "MANIFEST"), to_v1)
    info = EmbeddingStore.checkpoint_info(tmp_path / "ck")
    assert info["version"] == 1 and info["optimizer_spec"] == OptimizerSpec()
    t = EmbeddingStore.load(tmp_path / "ck")
    assert t.optimizer == OptimizerSpec() and _snapshot(t) == _snapshot(s)
    t.apply_sgd(torch.tensor([1]), torch.ones(1, 8), 0.1)  # an SGD store as before
    assert EmbeddingStore.load(tmp_path / "ck", optimizer="sgd").optimizer.kind == "sgd"
    rewrite_manifest(
        str(tmp_path / "ck" / "MANIFEST"), lambda t: t.replace('"name": "sgd"', '"name": "adam"')
    )
    with pytest.raises(ValueError, match=r"optimizer\.name"):
        EmbeddingStore.load(tmp_path / "ck")


def test_damaged_state_files_are_refused(tmp_path: Path) -> None:
    s = _trained("adagrad")
    s.save(tmp_path / "ck")
    f = tmp_path / "ck" / "state-0002.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        EmbeddingStore.load(tmp_path / "ck")
    f.write_bytes(bytes(data[:-4]))
    with pytest.raises(ValueError, match="torn"):
        EmbeddingStore.load(tmp_path / "ck")
    f.unlink()
    with pytest.raises(ValueError, match="missing"):
        EmbeddingStore.load(tmp_path / "ck")


def test_save_refuses_to_replace_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    s = EmbeddingStore(dim=4, **INIT)
    with pytest.raises(ValueError, match="neither empty nor a checkpoint"):
        s.save(tmp_path / "data")
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        s.save(tmp_path / "file")


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from torchrec_bagpipe.ps import EmbeddingStore
    path, n = sys.argv[1], int(sys.argv[2])
    s = EmbeddingStore(dim=32, init="zeros", num_threads=2)
    keys = torch.arange(n)
    for v in range(10**6):
        s.assign(keys, torch.full((n, 32), float(v)))
        s.save(path, meta={"v": str(v)})
        print(v, flush=True)
    """
)


@pytest.mark.slow
def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    n = 200_000  # ~25 MiB of rows: a save takes long enough to be interrupted
    path = tmp_path / "ck"
    rng = np.random.default_rng(0)
    seen_versions = set()
    for attempt in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(n)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()  # one save has completed
            assert first.strip().isdigit(), first
            # Wait until the next save is in progress (its temp directory exists), then
            # kill it at a random point of the save.
            deadline = time.monotonic() + 60
            while not any(n.startswith(".ck.tmp-") for n in os.listdir(tmp_path)):
                assert time.monotonic() < deadline, "the writer never started a second save"
            time.sleep(float(rng.uniform(0.0, 0.03)))
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
        t = EmbeddingStore.load(path)
        v = int(t.meta["v"])
        seen_versions.add(v)
        assert len(t) == n
        rows = t.lookup(torch.arange(n), insert_missing=False)
        assert bool((rows == float(v)).all()), f"attempt {attempt}: rows disagree with meta v={v}"
    # The next save removes temp directories the killed writers left behind.
    EmbeddingStore(dim=4, init="zeros").save(path)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
