#!/usr/bin/env bash
# One node of a multi-node `mixprec train` job: run this on every node, with the same arguments.
#
#   HEAD=10.0.0.1 NNODES=2 NPROC_PER_NODE=8 examples/multinode/torchrun_node.sh \
#       --parallel.reduce fp32_accumulate_hierarchical --training.out-dir /shared/runs/r1 --parallel.timeout 300
#
# HEAD: an address of the node that hosts torchrun's c10d rendezvous store, reachable from every node (on that
#       node this script passes is_host=1 when HEAD is one of its own addresses).
# NNODES, NPROC_PER_NODE: the job's shape; mixprec takes its topology from torchrun's LOCAL_WORLD_SIZE (= the
#       ranks per node) and WORLD_SIZE, GROUP_WORLD_SIZE (see docs/multinode.md).
# PORT (29500), RDZV_ID (mixprec): the rendezvous port and the job's id, the same on every node.
# LOCAL_ADDR: this node's address as the others reach it (default: torchrun resolves the hostname, which
#       must then resolve to that address on every node).
# IFNAME: the network interface for gloo/NCCL traffic (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), if not the default.
# --training.out-dir must be on a filesystem every node sees.
set -euo pipefail
: "${HEAD:?set HEAD to the address of the rendezvous host}" "${NNODES:?set NNODES}" "${NPROC_PER_NODE:?set NPROC_PER_NODE}"
PORT=${PORT:-29500}
RDZV_ID=${RDZV_ID:-mixprec}
is_host=0
if ip -o addr show 2>/dev/null | grep -qw "inet6\? ${HEAD}/[0-9]*"; then is_host=1; fi
extra=()
if [[ -n ${LOCAL_ADDR:-} ]]; then extra+=(--local-addr "$LOCAL_ADDR"); fi
if [[ -n ${IFNAME:-} ]]; then export GLOO_SOCKET_IFNAME=$IFNAME NCCL_SOCKET_IFNAME=$IFNAME; fi
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$RDZV_ID" --rdzv-conf "is_host=$is_host" \
    "${extra[@]}" -m mixprec.cli.main train "$@"
