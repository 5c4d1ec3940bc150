#!/bin/bash
# A Cloud TPU VM pod slice (e.g. v4-32: 4 workers x 4 chips): the same command on every
# worker at once. JAX detects the pod from the TPU VM metadata (jax._src.clusters
# GceTpuCluster: worker number, worker list, coordinator = worker 0 on port 8482), so no
# JAX_* variable is set; set none (all three set would turn the detection off).
#
#   TPU=my-v4-32 ZONE=us-central2-b bash experiments/launch/tpu_vm_pod.sh
#
# What to set:
# - TPU, ZONE (and gcloud's project): the slice, created beforehand, e.g.
#   gcloud compute tpus tpu-vm create $TPU --zone=$ZONE --accelerator-type=v4-32 \
#     --version=tpu-ubuntu2204-base
# - WORKDIR: a file system mounted at the same path on every worker (Filestore/NFS):
#   process 0 writes the records, every worker writes its checkpoint shards. The workdir
#   is a POSIX path (gs:// is not supported by its checks yet).
# - DATA / PREPARED: prepared once beforehand (see slurm.sbatch); each worker reads its own
#   shard files.
set -euo pipefail
: "${TPU:?set TPU=the TPU VM name}" "${ZONE:?set ZONE}"
WORKDIR=${WORKDIR:-/mnt/shared/runs/r50-tpu}
DATA=${DATA:-/mnt/shared/imagenet}
PREPARED=${PREPARED:-/mnt/shared/imagenet-prepared}

# Once: the checkout and its dependencies on every worker (jax with libtpu).
gcloud compute tpus tpu-vm scp --recurse --zone="$ZONE" --worker=all . "$TPU":~/hybridpar
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all \
  --command='pip install -q "jax[tpu]>=0.10,<0.11" && pip install -q -e ~/hybridpar'

# The run: one process per worker, all chips of the slice in one mesh. Detached from the
# ssh session (setsid nohup), so a dropped connection or a closed laptop does not kill the
# run; each worker's output goes to ~/hybridpar/train.log.
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="
  cd ~/hybridpar && setsid nohup python -m hybridpar.train \
    --config experiments/resnet50_imagenet.py:$DATA \
    --config.data.prepared_dir=$PREPARED \
    --workdir $WORKDIR \
    --config.distributed=True \
    --config.mesh=data:-1 > train.log 2>&1 < /dev/null &"
# Follow it (process 0 prints the progress; Ctrl-C here leaves the run going):
#   gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=0 --command="tail -f ~/hybridpar/train.log"
# Preempted or stopped? Run the same command again: it resumes from the workdir's latest
# checkpoint (a worker still running the old run holds the workdir lock and refuses it).
