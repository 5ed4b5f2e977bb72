"""torchx component of a BagPipe training job: a PS role and a trainer role.

    torchx run -s local_cwd torchrec_bagpipe/launch/component.py:bagpipe \\
        -j 2x1 --ps 1 --script examples/dlrm/dlrm_main.py -- --limit_train_batches 100
    torchx run -s kubernetes -cfg queue=default torchrec_bagpipe/launch/component.py:bagpipe \\
        --image my/image -j 2x8 --ps 4 --script examples/dlrm/dlrm_main.py -- ...
    torchx run -s slurm torchrec_bagpipe/launch/component.py:bagpipe -j 2x8 --ps 2 ...

Roles (shaped like torchx's ``dist.ddp``):

* ``ps`` (first role, ``--ps`` replicas): replica i runs ``torchrec_bagpipe.launch.ps_role``:
  one ``torchrec-bagpipe-ps`` shard server on a kernel-chosen port, announced in the job's
  rendezvous store; replica 0 hosts that store on port ``rdzv_port``. Being the first role,
  its host is what torchx's ``rank0_env`` names on every scheduler (``TORCHX_RANK0_HOST`` on
  local and Kubernetes, ``SLURM_JOB_NODELIST_HET_GROUP_0`` on Slurm, ...).
* ``trainer`` (``-j NxM``: N replicas of M processes): each replica runs
  ``torchrec_bagpipe.launch.trainer_role``, which takes the PS addresses and the job token
  from the store and runs ``torchrun`` with its c10d rendezvous on the same store.

So the PS addresses reach the trainers through the rendezvous: nothing is passed by hand,
and a job needs one reachable port (``rdzv_port``) plus the PS servers' ports. The PS
shards drain and exit when every trainer node is done (or lost), so the job ends with the
trainers. With ``--ps 0`` there is one role: the PS shards live inside the trainers and
trainer replica 0 hosts the store.
"""

# torchx reads the component's signature at run time (inspect, typing.Optional/Dict): no
# postponed annotations and no PEP 604 unions in this module.
from typing import Dict, Optional

import torchx
import torchx.specs as specs
from torchx.components.dist import parse_nnodes

__all__ = ["bagpipe"]


def bagpipe(
    *script_args: str,
    script: Optional[str] = None,
    m: Optional[str] = None,
    image: str = torchx.IMAGE,
    name: str = "bagpipe",
    j: str = "1x2",
    ps: int = 1,
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    ps_h: Optional[str] = None,
    ps_cpu: int = 2,
    ps_memMB: int = 4096,
    ps_host: str = "0.0.0.0",
    ps_type: str = "tcp",
    ps_args: str = "",
    python: str = "python",
    env: Optional[Dict[str, str]] = None,
    rdzv_port: int = 29500,
    heartbeat_timeout: float = 60.0,
    max_retries: int = 0,
    tee: int = 3,
    checkpoint_dir: Optional[str] = None,
    checkpoint_every: int = 0,
    resume: Optional[str] = None,
) -> specs.AppDef:
    """A BagPipe job: PS shard servers and torchrun trainers meeting in one rendezvous.

    Args:
        script_args: arguments of the training script or module
        script: the training script (e.g. examples/dlrm/dlrm_main.py)
        m: the training module instead of a script (python -m)
        image: image (docker) or directory (local) holding the code
        name: the job's name
        j: {nnodes}x{nproc_per_node}: trainer replicas and trainer processes per replica
        ps: PS shard servers (replicas of the ps role); 0: shards live in the trainers
        h: named resource of a trainer replica (takes precedence over cpu, gpu, memMB)
        cpu: cpus per trainer replica
        gpu: gpus per trainer replica
        memMB: memory (MB) per trainer replica
        ps_h: named resource of a PS replica (takes precedence over ps_cpu, ps_memMB)
        ps_cpu: cpus per PS replica
        ps_memMB: memory (MB) per PS replica
        ps_host: address the PS servers bind (0.0.0.0: every interface, announced under the
            machine's fully qualified name)
        ps_type: transport between trainers and PS servers: tcp or rdma (UCX)
        ps_args: extra torchrec-bagpipe-ps arguments, one string (e.g. "--memory-budget 64G
            --spill-dir /nvme/spill")
        python: the Python interpreter in the image
        env: environment variables of every replica (e.g. BAGPIPE_JOB_TOKEN=...)
        rdzv_port: port of the rendezvous store on the first PS replica (trainer replica 0
            with ps=0)
        heartbeat_timeout: seconds without a trainer node's heartbeat before the PS shards
            take it as lost and drain
        max_retries: scheduler retries of a failed replica
        tee: torchrun --tee (0 none, 1 stdout, 2 stderr, 3 both)
        checkpoint_dir: whole-job checkpoints go here: an absolute path every replica sees
            (a shared file system); the PS servers checkpoint into its ps/shard-<i> parts
        checkpoint_every: a whole-job checkpoint every N training steps (needs
            checkpoint_dir or resume)
        resume: resume from the whole-job checkpoint in this directory (every replica sees
            it): the PS servers restore its set, the trainers their state; later
            checkpoints go there too unless checkpoint_dir says otherwise
    """
    if (script is None) == (m is None):
        raise ValueError("exactly one of --script and -m must be given")
    if ps < 0:
        raise ValueError(f"--ps must be >= 0, got {ps}")
    if ps_type not in ("tcp", "rdma"):
        raise ValueError(f"--ps_type must be tcp or rdma, got {ps_type!r}")
    if checkpoint_every < 0:
        raise ValueError(f"--checkpoint_every must be >= 0, got {checkpoint_every}")
    if checkpoint_every and not (checkpoint_dir or resume):
        raise ValueError("--checkpoint_every needs --checkpoint_dir (or --resume)")
    job_env = dict(env or {})
    if checkpoint_dir or resume:
        job_env["BAGPIPE_CHECKPOINT_DIR"] = str(checkpoint_dir or resume)
        job_env["BAGPIPE_CHECKPOINT_EVERY"] = str(checkpoint_every)
    if resume:
        job_env["BAGPIPE_RESUME"] = str(resume)
    checkpoint_args = [*(["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir else []),
                       *(["--resume", str(resume)] if resume else [])]
    min_nnodes, max_nnodes, nproc_per_node, _ = parse_nnodes(j)
    if min_nnodes != max_nnodes:
        raise ValueError(f"-j {j}: BagPipe jobs have a fixed number of trainer nodes")
    nnodes = max_nnodes
    rendezvous = ["--rendezvous-host-env", specs.macros.rank0_env,
                  "--rendezvous-port", str(rdzv_port), "--run-id", specs.macros.app_id]
    command = [script] if script is not None else ["-m", str(m)]
    trainer = specs.Role(
        name="trainer",
        image=image,
        entrypoint=python,
        args=["-m", "torchrec_bagpipe.launch.trainer_role", *rendezvous,
              "--node-rank", specs.macros.replica_id, "--nnodes", str(nnodes),
              "--nproc-per-node", str(nproc_per_node), "--ps-servers", str(ps),
              "--ps-type", ps_type, "--tee", str(tee),
              *(["--store-host-node", "0"] if ps == 0 else []),
              "--", *command, *script_args],
        num_replicas=nnodes,
        resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
        env=dict(job_env),
        port_map={"c10d": rdzv_port} if ps == 0 else {},
        max_retries=max_retries,
    )
    roles = [trainer]
    if ps:
        ps_role = specs.Role(
            name="ps",
            image=image,
            entrypoint=python,
            args=["-m", "torchrec_bagpipe.launch.ps_role", *rendezvous,
                  "--replica-id", specs.macros.replica_id, "--num-replicas", str(ps),
                  "--nnodes", str(nnodes), "--host", ps_host,
                  "--transport", ps_type, "--heartbeat-timeout", str(heartbeat_timeout),
                  f"--server-args={ps_args}", *checkpoint_args],
            num_replicas=ps,
            resource=specs.resource(cpu=ps_cpu, gpu=0, memMB=ps_memMB, h=ps_h),
            env=dict(job_env),
            port_map={"c10d": rdzv_port},
            max_retries=max_retries,
        )
        roles = [ps_role, trainer]  # first: rank0_env names PS replica 0's host
    return specs.AppDef(name=name, roles=roles)
