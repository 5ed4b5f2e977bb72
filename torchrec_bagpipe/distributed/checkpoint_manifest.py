"""The layout and manifest of a whole-job checkpoint directory (no torch, no collectives).

A whole-job checkpoint (`job_checkpoint.py`) is a *set*: every PS table at one committed step
and every trainer's state at the training step that produced it. A directory ``D`` holds

* ``D/MANIFEST.json`` — the last complete set: its label, the trainers' step, each PS
  table's committed step, the world size, the shard count and the partitioner that placed
  rows on the shards (a resume onto another shard count re-partitions with it). Written
  last, through a temporary file renamed into place: a set exists once its manifest does,
  and a crash at any moment leaves the previous manifest (and the set it names) intact;
* ``D/<label>/trainer-<rank>.pt`` — each trainer's state (`job_checkpoint.py`);
* ``D/ps/shard-<i>/<label>/table-<name>/`` — shard i's native table checkpoints, written by
  the shard itself (`PSClient.checkpoint(label=...)`) into its checkpoint directory, which
  is ``D/ps/shard-<i>`` for shards hosted by the trainers and for the launcher's servers;
  a server started by hand writes ``<its --checkpoint-dir>/<label>/`` instead.

Labels are ``step-<step>-<nonce>``: a set is never rewritten in place, even when one step is
checkpointed twice.

Thread-safety: plain functions over files.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MANIFEST", "Manifest", "ps_set_dir", "ps_set_dirs", "ps_shard_dir", "read_manifest",
           "trainer_file", "write_manifest"]

MANIFEST = "MANIFEST.json"
FORMAT = 1


@dataclass(frozen=True)
class Manifest:
    """One complete whole-job checkpoint set."""

    label: str
    step: int  # training steps done (the trainers' data position)
    tables: dict[str, int] = field(default_factory=dict)  # PS table -> committed step
    world_size: int = 1
    ps_shards: int = 1
    partitioner: str = "modulo"  # BagPipeConfig.partitioner of the job that wrote it
    format: int = FORMAT


def ps_shard_dir(directory: str | os.PathLike[str], shard: int) -> str:
    """Shard `shard`'s checkpoint directory under a job checkpoint directory."""
    return os.path.join(os.fspath(directory), "ps", f"shard-{shard}")


def ps_set_dir(directory: str | os.PathLike[str], shard: int, label: str) -> str:
    """Where shard `shard`'s tables of set `label` live (its `--restore-from`)."""
    return os.path.join(ps_shard_dir(directory, shard), label)


def ps_set_dirs(directory: str | os.PathLike[str], manifest: Manifest) -> list[str]:
    """Every shard's directory of `manifest`'s set, shard 0 first: what a shard of another
    shard count restores resharded (`PSShard(restore=[...])`, ``--restore-resharded``)."""
    return [ps_set_dir(directory, i, manifest.label) for i in range(manifest.ps_shards)]


def trainer_file(directory: str | os.PathLike[str], label: str, rank: int) -> str:
    return os.path.join(os.fspath(directory), label, f"trainer-{rank}.pt")


def read_manifest(directory: str | os.PathLike[str]) -> Manifest | None:
    """The last complete set in `directory`, or None when it holds none. A manifest that
    cannot be read is a ValueError naming the file."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"whole-job checkpoint manifest {path} cannot be read: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a format-{FORMAT} torchrec_bagpipe job manifest")
    try:
        return Manifest(label=str(data["label"]), step=int(data["step"]),
                        tables={str(k): int(v) for k, v in data["tables"].items()},
                        world_size=int(data["world_size"]), ps_shards=int(data["ps_shards"]),
                        partitioner=str(data.get("partitioner", "modulo")))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"whole-job checkpoint manifest {path} is malformed: {e}") from e


def write_manifest(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    """Publishes `manifest` atomically (temporary file, fsync, rename, fsync of the
    directory)."""
    d = os.fspath(directory)
    tmp = os.path.join(d, f".{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(manifest), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(d, MANIFEST))
    fsync_dir(d)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
