#!/usr/bin/env bash
# Submit one stage to SLURM with one task per GPU: --ntasks-per-node and --gres=gpu are both GPUS, --nodes
# is NODES, so the job's layout always matches the Trainer's devices and num_nodes.
#
#   GPUS=8 NODES=2 scripts/slurm/submit.sh cityscapes --norm mabn --data /data/cityscapes -- --trainer.max_epochs 100
#   GPUS=8 NODES=2 scripts/slurm/submit.sh --dry-run cityscapes --norm mabn   # print and check, submit nothing
#   AFTER=1001 GPUS=8 scripts/slurm/submit.sh cityscapes --norm mabn --data /data/cityscapes   # after job 1001
#
# Every submission is checked first, where it is submitted: the stage's dry run (python -m mabn <stage> ...
# --dry-run: arguments, norm, data layout, backbone or the job it waits for, devices, run folder) inside a
# simulated allocation of the job's shape. A job that fails it is not submitted: every problem found is printed,
# one error: line each, and the exit status is 2.
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
usage="usage: [GPUS=8] [NODES=1] scripts/slurm/submit.sh [--dry-run] pretrain|cityscapes|segment [python -m mabn options]"
stage="${1:?$usage}"
shift
GPUS="${GPUS:-8}"
NODES="${NODES:-1}"
problems=()  # the submission's own; the stage's check adds its own after them
if ! [[ "$GPUS" =~ ^[1-9][0-9]*$ && "$NODES" =~ ^[1-9][0-9]*$ ]]; then
    problems+=("a SLURM job needs GPUS >= 1 (GPUs per node) and NODES >= 1, got GPUS=$GPUS NODES=$NODES")
    check_gpus=8 check_nodes=1  # the rest is checked on the default layout
else
    check_gpus="$GPUS" check_nodes="$NODES"
fi

args=(--job-name="mabn-$stage" --nodes="$NODES" --ntasks-per-node="$GPUS" --gres="gpu:$GPUS"
      --cpus-per-task="${CPUS_PER_TASK:-8}" --time="${TIME:-2-00:00:00}")
[[ -n "${PARTITION:-}" ]] && args+=(--partition="$PARTITION")
[[ -n "${ACCOUNT:-}" ]] && args+=(--account="$ACCOUNT")
pending=""
if [[ -n "${AFTER:-}" ]]; then
    if [[ "$AFTER" =~ ^[0-9]+$ ]]; then
        args+=(--dependency="afterok:$AFTER" --kill-on-invalid-dep=yes)
        # The check runs now, before the job AFTER has written stage 1's backbone.
        pending=1
    else
        problems+=("AFTER=$AFTER: expected the id of a submitted job (a number)")
    fi
fi
[[ -n "$dry_run" ]] && echo "+ sbatch ${args[*]} $here/train.sbatch $stage $*"
for problem in "${problems[@]}"; do
    echo "error: $problem" >&2
done
# What the job would run, inside a simulated allocation of the same shape; its dry run prints the plan, or an
# error: line for each problem.
status=0
SLURM_JOB_ID=0 SLURM_JOB_NAME="mabn-$stage" SLURM_NNODES="$check_nodes" SLURM_NTASKS_PER_NODE="$check_gpus" \
    SLURM_NTASKS=$((check_gpus * check_nodes)) SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 \
    SLURM_SUBMIT_DIR="$PWD" DRY_RUN=1 BACKBONE_PENDING="$pending" bash "$here/train.sbatch" "$stage" "$@" || status=$?
if [[ "$status" -ne 0 || ${#problems[@]} -gt 0 ]]; then
    [[ -z "$dry_run" ]] && echo "nothing submitted: the job fails its check (above)" >&2
    exit 2
fi
[[ -n "$dry_run" ]] && exit 0
mkdir -p runs/slurm  # the job's --output folder must exist before it starts
exec sbatch "${args[@]}" "$here/train.sbatch" "$stage" "$@"
