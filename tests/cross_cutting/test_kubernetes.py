"""Kubernetes launches: the manifests in examples/k8s, and the environment their operators set, emulated
on loopback (each "pod" a process group of its own on 127.0.0.1).

Two ways a pod starts the recipe: under torchrun, told its topology by the operator's ``PET_*``
variables (PyTorchJob with ``nprocPerNode``, the JobSet example, Kubeflow Trainer v2's TrainJob, which sets
those five and nothing else); or as the pod's only process with
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (a PyTorchJob without torchrun), which
Lightning does not detect (its KubeflowEnvironment must be passed by hand) and would run as node 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import SHARED_DATA, assert_same_weights, free_port, raises_cli
from tests.launch import ROOT, start
from tests.marks import needs_mnist

EXAMPLES = ROOT / "examples" / "k8s"
POD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID")


# ---- the manifests ---------------------------------------------------------------------------------------


def check_container(container: dict, gpus: int, grace: int) -> None:
    """The recipe under torchrun, resuming from object storage, with the GPUs torchrun is told about."""
    from ddp_recipes.config.cli import parse_config
    from recipes.config import ResNetConfig
    from recipes.resnet import PROG

    assert container["image"] and ":" in container["image"]
    assert container["command"] == ["torchrun", "-m", "recipes.resnet"]
    argv = container["args"]
    cfg = parse_config(ResNetConfig, [*argv, "--accelerator", "cpu"], prog=PROG)  # the flags are the recipe's
    assert cfg.resume == "auto" and cfg.output_dir.startswith("s3://") and cfg.checkpoint_every_n_steps > 0
    assert "--devices" not in argv and "--num-nodes" not in argv  # torchrun's environment says
    for side in ("limits", "requests"):
        assert int(container["resources"][side]["nvidia.com/gpu"]) == gpus
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts  # loader workers need more than the container's 64 MB
    env = {e["name"]: e for e in container.get("env", [])}
    assert "DDP_RECIPES_CACHE_DIR" in env
    assert grace >= 120  # one step and one checkpoint upload, with room
    # torchrun SIGKILLs its workers --shutdown-timeout after its own SIGTERM (30 s unless told): the pod's
    # grace period is the ranks' only if torchrun waits for them nearly as long, and leaves itself time to exit.
    shutdown = int(env["PET_SHUTDOWN_TIMEOUT"]["value"])
    assert 120 <= shutdown < grace, (shutdown, grace)


def test_pytorchjob_manifest():
    job = yaml.safe_load((EXAMPLES / "pytorchjob.yaml").read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    spec = job["spec"]
    gpus = int(spec["nprocPerNode"])
    assert isinstance(spec["nprocPerNode"], str)  # the CRD's type: a quoted number
    assert spec["runPolicy"]["backoffLimit"] >= 1
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for role in replicas.values():
        assert role["restartPolicy"] == "OnFailure"
        pod = role["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the operator's required container name
        check_container(container, gpus, pod["terminationGracePeriodSeconds"])


# What Kubeflow Trainer v2's Torch plugin gives the container named "node" of every TrainJob pod, as its
# pkg/runtime/framework/plugins/torch/torch.go writes it (the same from v2.0.0 to v2.3.0), and which of them
# a TrainJob may not set (constants.TorchRunReservedEnvNames: its webhook refuses them).
TRAINER_PORT = 29500  # constants.ContainerTrainerPort
TRAINER_PET = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def trainjob_manifests() -> tuple[dict, dict]:
    """examples/k8s/trainjob.yaml: the ClusterTrainingRuntime, then the TrainJob that runs on it."""
    runtime, job = yaml.safe_load_all((EXAMPLES / "trainjob.yaml").read_text())
    return runtime, job


def trainer_pet_env(job: dict) -> list[dict]:
    """The PET_* entries the Trainer upserts into the node container for this TrainJob (torch.go)."""
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    return [{"name": "PET_NNODES", "value": str(trainer["numNodes"])},
            {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", "auto"))},
            {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
            {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},  # pod 0 of Job "node", JobSet DNS
            {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)}]


def trainjob_container(runtime: dict, job: dict) -> tuple[dict, dict]:
    """The pod spec and the node container a TrainJob's pods get: the runtime's, with the TrainJob's trainer
    image, command and args in place of the runtime's, its env merged by name, resourcesPerNode as the
    container's resources (the runtime sets none), and the Torch plugin's PET_* on top (jobset/builder.go,
    core/trainingruntime.go, torch.go)."""
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    (node,) = [c for c in pod["containers"] if c["name"] == "node"]
    trainer = job["spec"]["trainer"]
    env = {e["name"]: e for e in [*node.get("env", []), *trainer.get("env", []), *trainer_pet_env(job)]}
    return pod, {**node, **{k: trainer[k] for k in ("image", "command", "args") if k in trainer},
                 "env": list(env.values()), "resources": trainer["resourcesPerNode"]}


def trainjob_pod_env(job: dict, index: int, nproc: int, port: int) -> dict:
    """Pod ``index``'s environment from the TrainJob's PET_* entries, on loopback: the completion index for
    PET_NODE_RANK, 127.0.0.1 and ``port`` for pod 0's DNS name and port, ``nproc`` processes (CPU)."""
    env = {e["name"]: e.get("value") for e in trainer_pet_env(job)}
    return {**env, "PET_NODE_RANK": str(index), "PET_NPROC_PER_NODE": str(nproc), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port), "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "HOSTNAME": f"{job['metadata']['name']}-node-0-{index}"}


def test_trainjob_manifest():
    runtime, job = trainjob_manifests()
    assert runtime["apiVersion"] == job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert (runtime["kind"], job["kind"]) == ("ClusterTrainingRuntime", "TrainJob")
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "apiGroup": "trainer.kubeflow.org",
                                         "kind": "ClusterTrainingRuntime"}
    spec = runtime["spec"]
    assert "torch" in spec["mlPolicy"]  # the Torch plugin, which sets the PET_* variables
    assert spec["template"]["spec"]["failurePolicy"]["maxRestarts"] >= 1
    (rjob,) = spec["template"]["spec"]["replicatedJobs"]
    # The Trainer's rules: the trainer Job is labelled so, replicated once, and holds a container "node"; the
    # master address it writes names the Job "node".
    assert rjob["name"] == "node" and rjob.get("replicas", 1) == 1
    assert rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    jobspec = rjob["template"]["spec"]
    assert jobspec["completionMode"] == "Indexed" and jobspec["backoffLimit"] == 0  # the set restarts, not a pod
    trainer = job["spec"]["trainer"]
    assert not {e["name"] for e in trainer["env"]} & set(TRAINER_PET)  # the webhook refuses the Trainer's own
    assert trainer["numNodes"] >= 2 and isinstance(trainer["numProcPerNode"], int)
    pod, container = trainjob_container(runtime, job)
    assert pod["restartPolicy"] == "Never"
    check_container(container, trainer["numProcPerNode"], pod["terminationGracePeriodSeconds"])


def test_jobset_manifest():
    jobset = yaml.safe_load((EXAMPLES / "jobset.yaml").read_text())
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    spec = jobset["spec"]
    assert spec["failurePolicy"]["maxRestarts"] >= 1
    (replicated,) = spec["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert int(env["PET_NNODES"]["value"]) == job["parallelism"]
    assert env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"].endswith(
        "['batch.kubernetes.io/job-completion-index']")
    name, rjob = jobset["metadata"]["name"], replicated["name"]
    assert env["PET_MASTER_ADDR"]["value"] == f"{name}-{rjob}-0-0.{name}"  # pod 0's JobSet DNS name
    assert int(env["PET_MASTER_PORT"]["value"]) in [p["containerPort"] for p in container["ports"]]
    check_container(container, int(env["PET_NPROC_PER_NODE"]["value"]), pod["terminationGracePeriodSeconds"])


# ---- one process per pod, without torchrun: resolved in-process ---------------------------------------------


@pytest.fixture
def pod(monkeypatch):
    """This process as pod 1 of 2 started without torchrun."""
    for name in POD_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511",
                            KUBERNETES_SERVICE_HOST="10.0.0.1", HOSTNAME="resnet-worker-0").items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_a_pod_without_torchrun_is_one_node_of_world_size(pod):
    from ddp_recipes.config.world import check_node_env, launch_environment, resolve_world

    assert resolve_world(None, None) == (1, 2)
    check_node_env(2, "cpu")  # RANK is the node rank
    assert launch_environment() == ("one process per pod in Kubernetes pod resnet-worker-0 (no torchrun): RANK 1 of "
                                    "WORLD_SIZE 2, master 127.0.0.1:29511")
    with raises_cli(Exception, r"^--devices 4, but this pod was started as one process of WORLD_SIZE 2 .*torchrun "
                               r"--nproc-per-node 4 \(PyTorchJob: nprocPerNode\)"):
        resolve_world(4, None)
    with raises_cli(Exception, r"^--num-nodes 3 disagrees with WORLD_SIZE=2"):
        resolve_world(None, 3)
    pod.setenv("PET_NPROC_PER_NODE", "4")  # nprocPerNode set, but the command is not torchrun
    with raises_cli(Exception, r"^PET_NPROC_PER_NODE=4 \(PyTorchJob nprocPerNode\) but this pod's command is not "
                               r"torchrun"):
        resolve_world(None, None)
    pod.delenv("PET_NPROC_PER_NODE")
    pod.setenv("NODE_RANK", "0")
    with raises_cli(Exception, r"^NODE_RANK=0 but RANK=1 in a pod"):
        check_node_env(2, "cpu")


def test_a_trainjob_pod_whose_command_is_not_torchrun_is_refused_not_trained_alone(monkeypatch):
    """Kubeflow Trainer gives each pod only the PET_* variables, for torchrun: a `python -m recipes.X` command
    would make every pod a one-process world of its own, writing into the same --output-dir."""
    from ddp_recipes.config.world import resolve_world

    for name in (*POD_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("PET_NNODES", "2"), ("PET_NPROC_PER_NODE", "1"), ("PET_NODE_RANK", "1"),
                        ("PET_MASTER_ADDR", "job-node-0-0.job"), ("PET_MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    with raises_cli(Exception, r"^PET_NNODES=2: the operator .* not torchrun, so each pod would train alone; make "
                               r"the container's command torchrun -m recipes.<name>"):
        resolve_world(None, None)
    assert resolve_world(None, 2) == (1, 2)  # Lightning's own multi-node launch (--num-nodes 2) joins the others
    monkeypatch.setenv("NODE_RANK", "1")  # ... as does one told its node by the environment
    assert resolve_world(None, None) == (1, 1)
    monkeypatch.delenv("NODE_RANK")
    monkeypatch.setenv("PET_NNODES", "1")  # one node: a single pod's run is what it asked for
    assert resolve_world(None, None) == (1, 1)


def test_several_gpus_in_a_pod_without_torchrun_is_an_error_not_a_one_gpu_run(pod):
    from ddp_recipes.config import world

    pod.setattr(world, "cuda_devices", lambda: 4)  # a 4-GPU pod
    with raises_cli(Exception, r"this pod sees 4 GPUs but was started as one process .*3 would idle.*torchrun "
                               r"--nproc-per-node 4"):
        world.check_node_env(2, "cuda")


def test_rank_without_node_rank_is_not_node_0(monkeypatch):
    """A pod with RANK but not the rest of the per-pod variables, run by hand as one of 2 nodes."""
    from ddp_recipes.config.world import check_node_env

    for name in POD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    with raises_cli(Exception, r"^RANK=1 is set but NODE_RANK is not, with --num-nodes 2"):
        check_node_env(2)


def test_the_doctor_takes_the_pods_for_nodes_and_says_so(pod, capsys):
    from ddp_recipes.doctor.checks import preflight
    from ddp_recipes.doctor.config import DoctorConfig
    from ddp_recipes.doctor.report import print_preflight

    cfg = DoctorConfig(accelerator="cpu")
    assert (cfg.devices, cfg.num_nodes, cfg.node_rank, cfg.master_port) == (1, 2, 1, 29511)
    info, _ = preflight(cfg)
    print_preflight(cfg, info)
    assert "launched by: one process per pod in Kubernetes pod resnet-worker-0 (no torchrun)" in capsys.readouterr().out


# ---- emulated on loopback: two pods, two process groups -------------------------------------------------------

MNIST = ["-m", "recipes.mnist", "--accelerator", "cpu", "--data-dir", str(SHARED_DATA), "--no-download",
         "--max-steps", "6", "--no-diagnostics"]


def pods(args: list[str], env_of, tmp_path: Path, **options) -> list:
    procs = [start(args, env=env_of(i), cwd=tmp_path, drop=POD_VARS, port=False, **options) for i in range(2)]
    return [p.finish(timeout=300) for p in procs]


@needs_mnist
@pytest.mark.slow  # a long multi-process run: make test-slow (keeps make test near 10 min)
def test_two_pods_without_torchrun_train_as_one_world(tmp_path):
    port = free_port()
    out = tmp_path / "per-pod"
    env = lambda i: {"RANK": str(i), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",  # noqa: E731
                     "MASTER_PORT": str(port), "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    done = pods([*MNIST, "--output-dir", str(out)], env, tmp_path)
    for d in done:
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_nodes"] == 2 and summary["devices_per_node"] == 1
    assert "world size       2 (2 node(s) x 1 device(s), cpu)" in done[0].stdout


@pytest.fixture(scope="module")
def per_pod_weights(tmp_path_factory) -> Path:
    """The reference the torchrun launches below must match: the same 2-rank world started one process per pod
    (RANK/WORLD_SIZE), same seed and flags; its last.ckpt. Run once for the module."""
    tmp = tmp_path_factory.mktemp("per-pod-reference")
    port = free_port()
    env = lambda i: {"RANK": str(i), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # noqa: E731
    done = pods([*MNIST, "--output-dir", str(tmp / "out"), "--checkpoint-every-n-steps", "6"], env, tmp)
    for d in done:
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-3000:]
    return tmp / "out" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@needs_mnist
def test_two_pods_under_torchrun_with_the_operators_pet_variables(tmp_path, per_pod_weights):
    """What the PyTorchJob (nprocPerNode) and the JobSet example give each pod: torchrun with no topology
    flags, PET_* plus the operator's own RANK/WORLD_SIZE. Same world and seed as the per-pod launch: the
    same weights."""
    port = free_port()

    def env(i: int) -> dict:
        return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port), "RANK": str(i), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "KUBERNETES_SERVICE_HOST": "10.0.0.1"}

    out = tmp_path / "torchrun"
    done = pods(["-m", "torch.distributed.run", *MNIST, "--output-dir", str(out), "--checkpoint-every-n-steps", "6"],
                env, tmp_path)
    for d in done:
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_nodes"] == 2
    assert_same_weights(out / "checkpoints" / "last.ckpt", per_pod_weights)


@pytest.mark.slow
@needs_mnist
def test_two_trainjob_pods_under_torchrun_with_only_the_trainers_pet_variables(tmp_path, per_pod_weights):
    """What Kubeflow Trainer v2 gives each pod of examples/k8s/trainjob.yaml: the five PET_* variables and no
    RANK, WORLD_SIZE or MASTER_* (unlike the PyTorchJob), read by torchrun with no topology flags as in the
    manifest's command (the MNIST recipe, as in the other loopback runs), 1 process per pod on CPU. The same
    world as the per-pod launch, and the same weights."""
    runtime, job = trainjob_manifests()
    _, container = trainjob_container(runtime, job)
    nodes, port = job["spec"]["trainer"]["numNodes"], free_port()
    assert nodes == 2 and container["command"][:2] == ["torchrun", "-m"]  # no topology flags: PET_* only
    out = tmp_path / "trainjob"
    done = pods(["-m", "torch.distributed.run", *MNIST, "--output-dir", str(out), "--checkpoint-every-n-steps", "6"],
                lambda i: trainjob_pod_env(job, i, 1, port), tmp_path)
    for d in done:
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_nodes"] == 2 and summary["devices_per_node"] == 1
    assert "world size       2 (2 node(s) x 1 device(s), cpu)" in done[0].stdout
    assert_same_weights(out / "checkpoints" / "last.ckpt", per_pod_weights)


@pytest.mark.slow
def test_the_doctor_in_a_pod_reports_what_it_detected(tmp_path):
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOSTNAME": "resnet-master-0"}
    done = start(["-m", "ddp_recipes.doctor", "--accelerator", "cpu", "--max-bytes", "4K"], env=env, cwd=tmp_path,
                 drop=POD_VARS, port=False).finish(timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert ("launched by: one process per pod in Kubernetes pod resnet-master-0 (no torchrun): RANK 0 of "
            f"WORLD_SIZE 1, master 127.0.0.1:{port}") in done.stdout
    assert "1 process(es) x 1 node(s) = world 1" in done.stdout and done.stdout.strip().endswith("PASS")
