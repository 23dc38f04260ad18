#!/usr/bin/env bash
# Place every rlcli command of one recipe on the nodes of a Slurm allocation, watch them, end them.
#
#   launch.sh RECIPE [--dry-run]      (called by single-node.sbatch / multi-node.sbatch)
#
# Roles (the first node is the head):
#   head node        rl-sync, rl-orchestrate, rl-cache (light processes, no GPU)
#   trainer nodes    rl-train under torchrun: TRAIN_NODES nodes x GPUS_PER_NODE ranks, rendezvous on the
#                    first trainer node
#   inference nodes  one rl-infer per infer.engine.tensor_parallel_size GPUs of each node (INFER_NODES
#                    of them), or, on a single node, of the GPUs the trainer does not use; ids count up
#                    across nodes; on a one-GPU node (GPUS_PER_NODE=1) rl-infer and rl-train share GPU 0
#                    (size the engine's KV cache to leave the trainer room)
# Every process reads the same recipe and meets the others in RUN_DIR, which must be on a shared
# filesystem; the sockets of every command bind to BIND_HOST. Logs: RUN_DIR/logs/<process>.log (<command>-<id>, the
# names `rl-orchestrate up` gives them). The job ends 0 when rl-train and rl-orchestrate have
# both finished; if any process dies first, it names it, stops the rest and exits with its code.
#
# Environment: TRAIN_NODES (default 1, or 0 extra nodes when the job has one node), INFER_NODES
# (default: the nodes left), GPUS_PER_NODE (default 8), TRAIN_GPUS (single node: GPUs for rl-train,
# default half), RUN_DIR (default runs/<job name>-<job id>), RDZV_PORT (default 29500), BIND_HOST
# (interface the servers listen on, default 0.0.0.0),
# RLCLI_ARGS (extra flags for every command, e.g. dotted overrides).
set -euo pipefail

RECIPE=${1:?usage: launch.sh RECIPE [--dry-run]}
DRY_RUN=${2:-}
[ -f "$RECIPE" ] || { echo "rlcli-slurm: error: recipe $RECIPE not found" >&2; exit 2; }
: "${SLURM_JOB_NODELIST:?rlcli-slurm: error: not inside a Slurm allocation (no SLURM_JOB_NODELIST); use sbatch}"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NUM_NODES=${#NODES[@]}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-rlcli}-${SLURM_JOB_ID:-0}}
RDZV_PORT=${RDZV_PORT:-29500}
BIND_HOST=${BIND_HOST:-0.0.0.0}  # servers listen here; the registry advertises this host's address
read -r -a EXTRA <<< "${RLCLI_ARGS:-}"
if [ "$NUM_NODES" -eq 1 ]; then
  TRAIN_WORLD=${TRAIN_GPUS:-$(( GPUS_PER_NODE > 1 ? GPUS_PER_NODE / 2 : 1 ))}
else
  TRAIN_WORLD=$(( ${TRAIN_NODES:-1} * GPUS_PER_NODE ))
fi
# rl-orchestrate writes one rollout file per trainer data-parallel rank: the recipe's train.parallel.dp,
# or the trainer's ranks divided by its cp (the resolved recipe, RLCLI_ARGS included).
# Each rl-infer takes infer.engine.tensor_parallel_size GPUs (1 for the native engine).
read -r NUM_TRAIN_RANKS INFER_TP < <(rl-train --config "$RECIPE" "${EXTRA[@]}" --print-config --json | python3 -c '
import json, sys
cfg = json.load(sys.stdin)
p = cfg["train"]["parallel"]
print(p["dp"] if p["dp"] > 0 else int(sys.argv[1]) // p["cp"], cfg["infer"]["engine"].get("tensor_parallel_size", 1))' \
  "$TRAIN_WORLD")
COMMON=(--config "$RECIPE" --run-dir "$RUN_DIR" --orchestrate.num_train_ranks "$NUM_TRAIN_RANKS"
        --sync.host "$BIND_HOST" --orchestrate.host "$BIND_HOST" --train.host "$BIND_HOST" "${EXTRA[@]}")

# infer_plan NODE FIRST_ID GPU...: one rl-infer per INFER_TP of the GPUs listed (ids from FIRST_ID).
infer_plan() {
  local node=$1 id=$2; shift 2
  local gpus=("$@")
  if [ "${#gpus[@]}" -lt "$INFER_TP" ]; then
    echo "rlcli-slurm: error: rl-infer takes infer.engine.tensor_parallel_size=$INFER_TP GPUs but $node has ${#gpus[@]} for it; lower it or give inference more GPUs" >&2
    exit 2
  fi
  for (( g = 0; g + INFER_TP <= ${#gpus[@]}; g += INFER_TP )); do
    local visible
    visible=$(IFS=,; echo "${gpus[*]:$g:$INFER_TP}")
    PLAN+=("infer-$id|$node|env CUDA_VISIBLE_DEVICES=$visible rl-infer ${COMMON[*]} --id $id --infer.host $BIND_HOST")
    id=$(( id + 1 ))
  done
  NEXT_INFER_ID=$id
}

# name|node|command, in start order (servers first).
PLAN=()
HEAD=${NODES[0]}
PLAN+=("cache-0|$HEAD|rl-cache serve ${COMMON[*]} --cache.host $BIND_HOST")
PLAN+=("sync-0|$HEAD|rl-sync ${COMMON[*]}")
if [ "$NUM_NODES" -eq 1 ]; then
  TRAIN_GPUS=${TRAIN_GPUS:-$(( GPUS_PER_NODE > 1 ? GPUS_PER_NODE / 2 : 1 ))}
  if [ "$GPUS_PER_NODE" -eq 1 ] && [ "$TRAIN_GPUS" -eq 1 ]; then
    INFER_GPUS=(0)  # one GPU: rl-infer shares it with rl-train
  elif [ "$TRAIN_GPUS" -ge 1 ] && [ "$TRAIN_GPUS" -lt "$GPUS_PER_NODE" ]; then
    mapfile -t INFER_GPUS < <(seq "$TRAIN_GPUS" $(( GPUS_PER_NODE - 1 )))
  else
    echo "rlcli-slurm: error: TRAIN_GPUS=$TRAIN_GPUS does not fit GPUS_PER_NODE=$GPUS_PER_NODE with a GPU left for rl-infer; set TRAIN_GPUS between 1 and $(( GPUS_PER_NODE > 1 ? GPUS_PER_NODE - 1 : 1 ))" >&2
    exit 2
  fi
  TRAIN_VISIBLE=$(seq -s, 0 $(( TRAIN_GPUS - 1 )))
  PLAN+=("train-0|$HEAD|env CUDA_VISIBLE_DEVICES=$TRAIN_VISIBLE rl-train ${COMMON[*]} --nproc-per-node $TRAIN_GPUS --nnodes 1 --node-rank 0 --rdzv-endpoint $HEAD:$RDZV_PORT")
  infer_plan "$HEAD" 0 "${INFER_GPUS[@]}"
else
  TRAIN_NODES=${TRAIN_NODES:-1}
  INFER_NODES=${INFER_NODES:-$(( NUM_NODES - TRAIN_NODES ))}
  if [ "$TRAIN_NODES" -lt 1 ] || [ "$INFER_NODES" -lt 1 ] || [ $(( TRAIN_NODES + INFER_NODES )) -gt "$NUM_NODES" ]; then
    echo "rlcli-slurm: error: TRAIN_NODES=$TRAIN_NODES + INFER_NODES=$INFER_NODES must be >= 1 each and fit the job's $NUM_NODES nodes; change them or --nodes" >&2
    exit 2
  fi
  TRAIN_HEAD=${NODES[0]}
  for (( r = 0; r < TRAIN_NODES; r++ )); do
    PLAN+=("train-$r|${NODES[$r]}|rl-train ${COMMON[*]} --nproc-per-node $GPUS_PER_NODE --nnodes $TRAIN_NODES --node-rank $r --rdzv-endpoint $TRAIN_HEAD:$RDZV_PORT")
  done
  NEXT_INFER_ID=0
  for (( i = 0; i < INFER_NODES; i++ )); do
    infer_plan "${NODES[$(( TRAIN_NODES + i ))]}" "$NEXT_INFER_ID" $(seq 0 $(( GPUS_PER_NODE - 1 )))
  done
fi
PLAN+=("orchestrate-0|$HEAD|rl-orchestrate run ${COMMON[*]}")

if [ "$DRY_RUN" = "--dry-run" ]; then
  for entry in "${PLAN[@]}"; do IFS='|' read -r name node cmd <<< "$entry"; printf '%s\t%s\t%s\n' "$node" "$name" "$cmd"; done
  exit 0
fi

mkdir -p "$RUN_DIR/logs"
declare -A NAME_OF NODE_OF
PIDS=()
for entry in "${PLAN[@]}"; do
  IFS='|' read -r name node cmd <<< "$entry"
  srun --nodes=1 --ntasks=1 --overlap -w "$node" bash -c "exec $cmd" > "$RUN_DIR/logs/$name.log" 2>&1 &
  NAME_OF[$!]=$name; NODE_OF[$!]=$node; PIDS+=($!)
  echo "rlcli-slurm: started $name on $node (log $RUN_DIR/logs/$name.log)" >&2
done

stop_all() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 20); do alive=0; for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
                         [ "$alive" -eq 0 ] && break; sleep 0.5; done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'echo "rlcli-slurm: interrupted; stopping every process" >&2; stop_all; exit 130' INT TERM

is_finite() { [[ "$1" =~ ^(train-[0-9]+|orchestrate-0)$ ]]; }
finite_left=0
for p in "${PIDS[@]}"; do if is_finite "${NAME_OF[$p]}"; then finite_left=$(( finite_left + 1 )); fi; done
# Poll rather than `wait -n`: bash 4.4 (still common on clusters) has no `wait -n -p`.
while [ "$finite_left" -gt 0 ]; do
  sleep 2
  for p in "${PIDS[@]}"; do
    kill -0 "$p" 2>/dev/null && continue
    set +e; wait "$p"; code=$?; set -e
    name=${NAME_OF[$p]}
    # (`|| true`: when $p was last, the loop's status is the failed test, and set -e would end the script)
    PIDS=($(for q in "${PIDS[@]}"; do [ "$q" != "$p" ] && echo "$q"; done || true))
    if [ "$code" -ne 0 ] || ! is_finite "$name"; then
      echo "rlcli-slurm: error: $name on ${NODE_OF[$p]} exited with code $code; see $RUN_DIR/logs/$name.log" >&2
      stop_all
      exit $(( code == 0 ? 1 : code ))
    fi
    echo "rlcli-slurm: $name finished" >&2
    finite_left=$(( finite_left - 1 ))
  done
done
stop_all
echo "rlcli-slurm: run complete in $RUN_DIR" >&2
