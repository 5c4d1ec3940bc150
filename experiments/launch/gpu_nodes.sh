#!/bin/bash
# Multi-node GPU without a cluster manager: start this script on every node, by hand or
# with your own ssh loop, each with its own rank:
#
#   node 0 (10.0.0.1):  COORDINATOR=10.0.0.1:1234 NUM_NODES=2 bash experiments/launch/gpu_nodes.sh 0
#   node 1:             COORDINATOR=10.0.0.1:1234 NUM_NODES=2 bash experiments/launch/gpu_nodes.sh 1
#
# Arguments after the rank go to the trainer as they are, after this script's own, so an
# override there wins: ... gpu_nodes.sh 0 --config.num_epochs=40 --config.global_batch=512
# (the same on every node).
#
# What to set:
# - COORDINATOR: node 0's address as the other nodes reach it, and a free TCP port there;
#   process 0 starts JAX's coordinator on that port (every interface), the others connect
#   to it. The same value on every node.
# - NUM_NODES: how many processes join (one per node here); the rank is 0..NUM_NODES-1.
# - GPUS: the GPUs this process drives, e.g. 0,1,2,3 (by default all of the node's, as
#   nvidia-smi lists them; without nvidia-smi, set it).
# - WORKDIR: the same path on every node, on a shared file system (process 0 writes the
#   records, every process writes its checkpoint shards there).
# - DATA / PREPARED: prepared once beforehand (see slurm.sbatch).
#
# The processes wait up to --config.distributed_timeout_s (300 s) for each other; a
# missing or wrong variable, a taken port or a coordinator that never answers stops with
# one `error:` line naming it. Start node 0 first or within that time of the others.
# NCCL picks the network itself; NCCL_SOCKET_IFNAME=eth0 (say) pins an interface.
set -euo pipefail
RANK=${1:?usage: gpu_nodes.sh RANK [--config.KEY=VALUE ...] (RANK 0 on the coordinator node)}
shift

fail() { echo "error: $*" >&2; exit 2; }
# Not in one `export X=$(...)` line: export's own status would hide a failed nvidia-smi
# and export an empty list, which JAX reads as every device.
if [ -z "${GPUS:-}" ]; then
  command -v nvidia-smi >/dev/null ||
    fail "nvidia-smi not found to list this node's GPUs: set GPUS=0,1,... (the GPUs this process drives)"
  GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,) ||
    fail "nvidia-smi could not list this node's GPUs (above): set GPUS=0,1,... (the GPUs this process drives)"
  [ -n "$GPUS" ] || fail "nvidia-smi lists no GPU on this node: set GPUS=0,1,... or run on a GPU node"
fi

export JAX_COORDINATOR_ADDRESS=${COORDINATOR:?set COORDINATOR=HOST:PORT of node 0}
export JAX_NUM_PROCESSES=${NUM_NODES:?set NUM_NODES}
export JAX_PROCESS_ID=$RANK
export JAX_LOCAL_DEVICE_IDS=$GPUS

exec python -m hybridpar.train \
  --config "experiments/resnet50_imagenet.py:${DATA:-/shared/imagenet}" \
  --config.data.prepared_dir="${PREPARED:-/shared/imagenet-prepared}" \
  --workdir "${WORKDIR:-/shared/runs/r50}" \
  --config.distributed=True \
  --config.mesh=data:-1 \
  "$@"
