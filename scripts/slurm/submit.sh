#!/usr/bin/env bash
# Submit one stage to SLURM with one task per GPU: --ntasks-per-node and --gres=gpu are both GPUS, --nodes
# is NODES, so the job's layout always matches the Trainer's devices and num_nodes.
#
#   GPUS=8 NODES=2 scripts/slurm/submit.sh cityscapes --norm mabn --data /data/cityscapes -- --trainer.max_epochs 100
#   GPUS=8 NODES=2 scripts/slurm/submit.sh --dry-run cityscapes --norm mabn   # print and check, submit nothing
#   AFTER=1001 GPUS=8 scripts/slurm/submit.sh cityscapes --norm mabn --data /data/cityscapes   # after job 1001
#
# Environment: GPUS (per node, default 8), NODES (default 1), TIME (default 2-00:00:00), PARTITION,
# ACCOUNT, CPUS_PER_TASK (default 8), PYTHON (default .venv/bin/python), AFTER (a job id: start only once that
# job has succeeded, e.g. stage 2 after the stage-1 job that writes its backbone). Run from the repository root.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
dry_run=""
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=1
    shift
fi
stage="${1:?usage: [GPUS=8] [NODES=1] scripts/slurm/submit.sh [--dry-run] pretrain|cityscapes [python -m mabn options]}"
shift
GPUS="${GPUS:-8}"
NODES="${NODES:-1}"
if ! [[ "$GPUS" =~ ^[1-9][0-9]*$ && "$NODES" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: a SLURM job needs GPUS >= 1 (GPUs per node) and NODES >= 1, got GPUS=$GPUS NODES=$NODES" >&2
    exit 2
fi

args=(--job-name="mabn-$stage" --nodes="$NODES" --ntasks-per-node="$GPUS" --gres="gpu:$GPUS"
      --cpus-per-task="${CPUS_PER_TASK:-8}" --time="${TIME:-2-00:00:00}")
[[ -n "${PARTITION:-}" ]] && args+=(--partition="$PARTITION")
[[ -n "${ACCOUNT:-}" ]] && args+=(--account="$ACCOUNT")
pending=""
if [[ -n "${AFTER:-}" ]]; then
    if ! [[ "$AFTER" =~ ^[0-9]+$ ]]; then
        echo "error: AFTER=$AFTER: expected the id of a submitted job (a number)" >&2
        exit 2
    fi
    args+=(--dependency="afterok:$AFTER" --kill-on-invalid-dep=yes)
    # The check runs now, before the job AFTER has written stage 1's backbone.
    pending=1
fi
if [[ -n "$dry_run" ]]; then
    echo "+ sbatch ${args[*]} $here/train.sbatch $stage $*"
    # What the job would run, inside a simulated allocation of the same shape.
    SLURM_JOB_ID=0 SLURM_JOB_NAME="mabn-$stage" SLURM_NNODES="$NODES" SLURM_NTASKS_PER_NODE="$GPUS" \
        SLURM_NTASKS=$((GPUS * NODES)) SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_SUBMIT_DIR="$PWD" \
        DRY_RUN=1 BACKBONE_PENDING="$pending" bash "$here/train.sbatch" "$stage" "$@"
    exit 0
fi
mkdir -p runs/slurm  # the job's --output folder must exist before it starts
exec sbatch "${args[@]}" "$here/train.sbatch" "$stage" "$@"
