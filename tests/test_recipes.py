"""The experiment configs: each loads and passes the config checks, and the benchmark
recipes say what their write-ups say (stages, peak LR at the published batch, targets)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridpar.config.curriculum import stages_from_config
from hybridpar.config.errors import ConfigError
from hybridpar.config.schema import load_config, unused_settings, validate
from hybridpar.program.optim import lr_batch_factor

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("path", sorted(p.name for p in EXPERIMENTS.glob("*.py")))
def test_every_experiment_loads_and_passes_the_checks(path):
    c = load_config(str(EXPERIMENTS / path))
    validate(c)
    assert stages_from_config(c, 8)  # the stage string, if any, parses


def _imagenets(tmp_path) -> dict:
    """An ImageNet of each kind the recipes take (``resnet50_imagenet.py``): train/ and val/
    folders, and image-net.org's archives; empty, as the recipes look at the names only."""
    folders, archives = tmp_path / "folders", tmp_path / "archives"
    for split in ("train", "val"):
        (folders / split).mkdir(parents=True)
    archives.mkdir()
    for name in ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar"):
        (archives / name).touch()
    return {"folders": folders, "archives": archives}


IMAGENET_RECIPES = {
    "resnet50_imagenet.py": [""],
    "resnet50_imagenet_dawnbench.py": ["", ",8"],
    "resnet50_imagenet_ffcv.py": ["", ",40"],
    "resnet50_imagenet_mlperf.py": ["", ",32768"],
}
EVERY_VARIANT = [
    "cifar10.py", "cifar10_fast.py", "cifar10_fast.py:gpu", "cifar10_fast.py:cpu",
    "cifar10_fast.py:edge", "cifar10_fast.py:gpu,8", "digits.py", "resnet50_100k_classes.py",
    "resnet50_1m_classes.py", "resnet50_1m_classes.py:100352", "wide_resnet50_2.py",
    "wide_resnet50_2.py:34",
    *(f"{name}:{where}{more}" for name, mores in IMAGENET_RECIPES.items()
      for where in ("", "{folders}", "{archives}") for more in mores),
]  # fmt: skip


@pytest.mark.parametrize("spec", EVERY_VARIANT)
def test_no_recipe_warns_of_its_own_settings(spec, tmp_path):
    """Set-up warns of each setting that does nothing (``unused_settings``): a recipe run as
    its docstring says must not warn of what the user never passed. The stage recipes warned
    of resnet50_imagenet.py's global_batch (the stages set the batches) and dawnbench of its
    reduced copy on data that is not prepared here (synthetic, tensorflow-datasets'). Planted
    bugs that fail it: dawnbench or ffcv keeping global_batch=1024, dawnbench setting
    data.reduced_copies whatever the data."""
    c = load_config(str(EXPERIMENTS / spec.format(**_imagenets(tmp_path))))
    assert unused_settings(c) == []
    if spec.startswith("resnet50_imagenet_dawnbench.py:{folders}"):  # MoXing's 160-px copy
        assert c.data.name == "images" and c.data.reduced_copies == "160"


def test_every_recipe_is_in_the_table_of_its_variants():
    assert {spec.partition(":")[0] for spec in EVERY_VARIANT} == {
        p.name for p in EXPERIMENTS.glob("*.py")
    }


def _peak_lr(c, global_batch):
    return c.optim.base_lr * float(lr_batch_factor(c.optim, global_batch))


@pytest.mark.parametrize("gpus", [128, 8, 1])
def test_dawnbench_is_moxings_schedule_on_any_gpu_count(gpus):
    c = load_config(str(EXPERIMENTS / f"resnet50_imagenet_dawnbench.py:,{gpus}"))
    stages = stages_from_config(c, gpus)
    assert [(s.end_epoch, s.image_size, s.global_batch // gpus, s.min_scale) for s in stages] == [
        (21, 128, 224, 0.08), (42, 224, 224, 0.087), (44, 288, 128, 0.5)]  # fmt: skip
    # MoXing's peak LR of 8.5 at its 128-GPU 128-px batch, linear in the batch elsewhere
    assert _peak_lr(c, stages[0].global_batch) == pytest.approx(8.5 * gpus / 128)
    assert (c.optim.momentum_start, c.optim.momentum) == (0.98, 0.9)
    assert c.target_top5 == 0.93
    # the count pins the mesh: on another count the global batch and the LR would differ
    assert c.mesh == f"data:{gpus}"


def test_dawnbench_without_a_count_takes_every_device_and_a_count_pins_it():
    """Without ``,N`` the data axis takes every device; with it a start on another count is
    the mesh's error, not a run at another global batch (the count was checked, then
    ignored). Planted bug that fails it: the count not set as the mesh."""
    from hybridpar import make_mesh

    c = load_config(str(EXPERIMENTS / "resnet50_imagenet_dawnbench.py:"))
    assert c.mesh == "data:-1" and make_mesh(c.mesh).shape["data"] == 8
    assert make_mesh(load_config(str(EXPERIMENTS / "resnet50_imagenet_dawnbench.py:,8")).mesh)
    with pytest.raises(ConfigError, match="8"):
        make_mesh(load_config(str(EXPERIMENTS / "resnet50_imagenet_dawnbench.py:,64")).mesh)


def test_mlperf_is_lars_with_polynomial_decay_to_75_9():
    c = load_config(str(EXPERIMENTS / "resnet50_imagenet_mlperf.py"))
    assert (c.optim.name, c.optim.schedule, c.target_top1) == ("lars", "poly", 0.759)
    assert _peak_lr(c, c.global_batch) == pytest.approx(10.5)
    big = load_config(str(EXPERIMENTS / "resnet50_imagenet_mlperf.py:,32768"))
    assert _peak_lr(big, 32768) == pytest.approx(10.5 * (32768 / 3264) ** 0.5)
    assert big.num_epochs > c.num_epochs  # larger batches need more epochs


@pytest.mark.parametrize("epochs,switch", [(16, 12.6), (40, 31.5), (88, 69.3)])
def test_ffcv_has_two_train_shapes_switching_late(epochs, switch):
    c = load_config(str(EXPERIMENTS / f"resnet50_imagenet_ffcv.py:,{epochs}"))
    stages = stages_from_config(c, 8)
    assert [(s.end_epoch, s.image_size) for s in stages] == [(switch, 160), (epochs, 192)]
    assert c.data.image_size == 256 and c.num_epochs == epochs


def test_cifar10_fast_says_its_global_batch_on_more_devices_or_keeps_it():
    """Its stages' batches are per device: on 8 GPUs ``gpu`` is 8x the batch of one, and the
    plan the trainer logs at set-up says so first; ``gpu,8`` keeps one GPU's batches."""
    from hybridpar.config.curriculum import describe, plan_stages

    def plan(spec, devices):
        stages = stages_from_config(load_config(str(EXPERIMENTS / spec)), devices)
        return plan_stages(stages, lambda batch: 50_000 // batch)  # CIFAR-10's train split

    one = describe(plan("cifar10_fast.py:gpu", 1)).splitlines()
    assert one[0].startswith("stage 0:") and "global batch 1024, 192 steps (48/epoch)" in one[0]
    eight = describe(plan("cifar10_fast.py:gpu", 8)).splitlines()
    assert "per data-parallel device: x8 here, so global batches 8192, 4096" in eight[0]
    assert "global batch 8192, 24 steps (6/epoch)" in eight[1]
    kept = plan("cifar10_fast.py:gpu,8", 8)
    assert [s.stage.global_batch for s in kept.stages] == [1024, 512]
    assert "global batches 1024, 512 (128, 64 a device)" in describe(kept)


@pytest.mark.parametrize(
    "spec,expect",
    [
        ("resnet50_imagenet_dawnbench.py:,eight", "'eight' is not a device count"),
        ("resnet50_imagenet_mlperf.py:,big", "'big' is not a global batch; pass WHERE,BATCH"),
        ("resnet50_imagenet_mlperf.py:,0", "'0' is not a global batch"),
        ("resnet50_1m_classes.py:abc", r"'abc' is not a class count; .* \(e.g. :100352\)"),
        ("resnet50_1m_classes.py:1", "'1' is not a class count"),
        ("resnet50_imagenet_ffcv.py:,17", "the epochs are one of"),
        ("cifar10_fast.py:gpu,3", "the device count must divide"),
    ],
)
def test_bad_recipe_arguments_are_config_errors(spec, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(str(EXPERIMENTS / spec))


LAUNCH = EXPERIMENTS / "launch"


@pytest.mark.parametrize("completed", [False, True])
def test_slurm_recipe_requeues_a_stopped_run_into_the_same_workdir(tmp_path, completed):
    """slurm.sbatch run by bash with stand-ins for srun and scontrol on PATH: srun gets the
    CPUs per task (srun no longer inherits them from sbatch) and a workdir named by the
    job's name, not its id, so a requeued or resubmitted job resumes the same run; a run
    stopped with a checkpoint (exit 0, not completed) requeues the job, a completed one
    does not."""
    import os
    import subprocess

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    summary = '{"completed": true}' if completed else '{"completed": false}'
    (bin_ / "srun").write_text(
        '#!/bin/bash\necho "$@" > "$LOG/srun"\n'
        'while [ "$1" != --workdir ]; do shift; done\n'
        f'mkdir -p "$2" && echo \'{summary}\' > "$2/summary.json"\n'
    )
    (bin_ / "scontrol").write_text('#!/bin/bash\necho "$@" > "$LOG/scontrol"\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", LOG=str(tmp_path),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="hybridpar", SLURM_CPUS_PER_TASK="32",
               SLURM_GPUS_ON_NODE="8")  # fmt: skip
    r = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch")], cwd=tmp_path, env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    srun = (tmp_path / "srun").read_text()
    assert "--cpus-per-task=32" in srun
    assert f"--workdir {tmp_path}/runs/r50-slurm-hybridpar " in srun and "4242" not in srun
    requeued = (tmp_path / "scontrol").exists()
    assert requeued != completed
    if requeued:
        assert (tmp_path / "scontrol").read_text().split() == ["requeue", "4242"]
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=TERM@" in text


def test_jobset_mounts_a_memory_backed_dev_shm_for_nccl():
    yaml = pytest.importorskip("yaml")
    pod = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
    pod = pod["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
    assert pod["terminationGracePeriodSeconds"] >= 60  # time to save at a step boundary


FAKE_TRAINER = """#!/bin/bash
echo "$@" > "$LOG/args"
while [ "$1" != --workdir ]; do shift; done
mkdir -p "$2" && cd "$2"
case $MODE in
  completed) echo '{"completed": true}' > summary.json ;;
  failed) exit 3 ;;
  drained)  # SIGTERM: stop with a checkpoint, exit 0
    stop() { echo TERM > "$LOG/signal"; echo '{"completed": false}' > summary.json; exit 0; }
    trap stop TERM
    touch "$LOG/started"
    while :; do sleep 0.05; done ;;
esac
"""


@pytest.mark.parametrize("mode,exit_code", [("completed", 0), ("drained", 1), ("failed", 3)])
def test_jobset_command_fails_the_pod_while_the_run_is_unfinished(tmp_path, mode, exit_code):
    """The container's command run by sh with a stand-in trainer as python: a node drain's
    SIGTERM reaches the trainer, which saves and exits 0 with summary.json not completed;
    the command then exits 1, so the JobSet restarts the run rather than count the pod as
    succeeded. A completed run exits 0; a failed trainer's exit code passes through."""
    import os
    import signal
    import subprocess
    import time

    yaml = pytest.importorskip("yaml")
    pod = yaml.safe_load((LAUNCH / "jobset.yaml").read_text())
    (container,) = pod["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ]
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python").write_text(FAKE_TRAINER)
    (bin_ / "python").chmod(0o755)
    workdir = tmp_path / "run"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", LOG=str(tmp_path), MODE=mode,
               WORKDIR=str(workdir))  # fmt: skip
    p = subprocess.Popen(container["command"], cwd=tmp_path, env=env, start_new_session=True)
    try:
        if mode == "drained":
            deadline = time.monotonic() + 60
            while not (tmp_path / "started").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            while p.poll() is None and time.monotonic() < deadline:
                p.send_signal(signal.SIGTERM)  # as Kubernetes does: to the container's PID 1
                time.sleep(0.2)
            assert (tmp_path / "signal").read_text() == "TERM\n"  # passed on to the trainer
        assert p.wait(timeout=60) == exit_code
    finally:  # the stand-in too, where it outlived its shell
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    assert f"--workdir {workdir} " in (tmp_path / "args").read_text()


def test_tpu_vm_recipe_trains_detached_from_the_ssh_session():
    import subprocess

    assert subprocess.run(["bash", "-n", str(LAUNCH / "tpu_vm_pod.sh")]).returncode == 0
    run = (LAUNCH / "tpu_vm_pod.sh").read_text().split("# The run:")[1]
    assert "setsid nohup python -m hybridpar.train" in run and '< /dev/null &"' in run


def test_cifar10_fast_edge_fits_the_compress_budget_from_the_start():
    """The ``edge`` variant is the size ``compress --budget-kb 100`` prunes ``cpu`` to: its
    int8 weights (quantize's own count, from the shapes) within 100 KB, and under half of
    ``cpu``'s."""
    import jax
    from flax.core import meta

    from hybridpar.models import AirbenchNet
    from hybridpar.tools import prune

    def int8_kb(variant):
        c = load_config(str(EXPERIMENTS / f"cifar10_fast.py:{variant}"))
        model = AirbenchNet(num_classes=c.data.num_classes, num_filters=c.model.num_filters)
        v = meta.unbox(model.init(jax.random.key(0), jax.numpy.zeros((1, 32, 32, 3)), train=False))
        gs = prune.groups(model, v["params"])
        return prune.int8_bytes(model, gs, v["params"], v["batch_stats"], {}) / 1000

    edge, cpu = int8_kb("edge"), int8_kb("cpu")
    assert edge <= 100 and edge < cpu / 2, (edge, cpu)


# ---- experiments/launch/gpu_nodes.sh, run by bash with stand-ins for python (the trainer) and
# nvidia-smi on a PATH that holds only them and paste


def _gpu_nodes(tmp_path, nvidia_smi: bool, *args, **more_env):
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "python").write_text(
        '#!/bin/bash\necho "$JAX_LOCAL_DEVICE_IDS" > "$LOG/ids"\necho "$@" > "$LOG/args"\n'
    )
    if nvidia_smi:
        (bin_ / "nvidia-smi").write_text("#!/bin/bash\nprintf '0\\n1\\n'\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    if not (bin_ / "paste").exists():
        os.symlink(shutil.which("paste"), bin_ / "paste")
    env = {"PATH": str(bin_), "LOG": str(tmp_path), "COORDINATOR": "10.0.0.1:1234",
           "NUM_NODES": "2", **more_env}  # fmt: skip
    cmd = [shutil.which("bash"), str(LAUNCH / "gpu_nodes.sh"), "1", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)


def test_extra_arguments_reach_the_trainer_after_its_own(tmp_path):
    """They were dropped: no --config override could be added."""
    r = _gpu_nodes(tmp_path, True, "--config.num_epochs=40", "--config.global_batch=512")
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "args").read_text().split()
    assert args[-2:] == ["--config.num_epochs=40", "--config.global_batch=512"], args
    assert "--config.distributed=True" in args
    assert (tmp_path / "ids").read_text() == "0,1\n"


def test_no_nvidia_smi_and_no_gpus_is_one_error_line(tmp_path):
    """It printed "nvidia-smi: command not found" and went on with an empty
    JAX_LOCAL_DEVICE_IDS (export's status hid the failure under set -e)."""
    r = _gpu_nodes(tmp_path, False)
    assert r.returncode == 2 and not (tmp_path / "args").exists(), r
    assert r.stderr.startswith("error: nvidia-smi not found") and "set GPUS=" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert _gpu_nodes(tmp_path, False, GPUS="2,3").returncode == 0  # GPUS set: no nvidia-smi needed
    assert (tmp_path / "ids").read_text() == "2,3\n"
