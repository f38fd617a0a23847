#!/usr/bin/env bash
# gpu_acceptance's multi-rank sections on one GPU, under the NCCL that build.sh made (LD_PRELOAD: NCCL
# keeps its ABI within 2.x, and NCCL_MULTI_RANK_GPU_ENABLE=1 needs >= 2.30), e.g.
#   bash benchmarks/nccl/run_multi_rank.sh --out docs/gpu-runs/h200-multi-rank.json
# SECTIONS picks the sections (default e,f,g,h: two ranks on one GPU, the 2-stage pipeline, wide and
# folded stages on 4 ranks, the job's kill drill on 5 ranks); the other arguments go to gpu_acceptance.py.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
lib=${NCCL_LIB:-$here/.nccl/lib/libnccl.so.2}
[ -f "$lib" ] || { echo "run_multi_rank.sh: no $lib: build it with benchmarks/nccl/build.sh" >&2; exit 2; }
export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
# Ranks sharing one GPU share its SMs: a collective's kernel spins until every peer's kernel runs, so
# the ranks' resident kernels together must fit (an H100/H200 has 132 SMs; 5 ranks with a few
# operations in flight each). NCCL's limits on CTAs per kernel, unless set already.
export NCCL_MAX_CTAS=${NCCL_MAX_CTAS:-8} NCCL_MAX_P2P_NCHANNELS=${NCCL_MAX_P2P_NCHANNELS:-8}
exec python3 "$here/benchmarks/gpu_acceptance.py" --only "${SECTIONS:-e,f,g,h}" "$@"
