#!/usr/bin/env bash
# Distributed testing with torchrun and MMEngine's `pytorch` launcher.
#   tools/dist_test.sh CONFIG CHECKPOINT GPUS [test.py ARGS]
# Multi-node: run on every node with NNODES, NODE_RANK, MASTER_ADDR (and PORT) set.
CONFIG=$1
CHECKPOINT=$2
GPUS=$3
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
PYTHON=${PYTHON:-python}

PYTHONPATH="$(dirname "$0")/..":$PYTHONPATH \
"$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$GPUS" \
    --master_port="$PORT" \
    "$(dirname "$0")/test.py" \
    "$CONFIG" \
    "$CHECKPOINT" \
    --launcher pytorch "${@:4}"
