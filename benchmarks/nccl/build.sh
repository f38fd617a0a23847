#!/usr/bin/env bash
# Build NCCL from source for one GPU architecture into .nccl/ (ignored by git), so that several ranks can
# share one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30) under a torch wheel built against an older NCCL.
# The library is loaded with LD_PRELOAD (NCCL keeps its ABI within 2.x); benchmarks/gpu_acceptance.py --nccl
# does that. It needs CUDA's compiler and headers, not a GPU: it builds on a CPU machine with nvcc.
#
#   bash benchmarks/nccl/build.sh                       # v2.30.7-1, sm_90 (H100/H200), from github.com/NVIDIA/nccl
#   NCCL_SRC=/path/to/nccl.git NCCL_ARCH=100 bash benchmarks/nccl/build.sh
#
# Why one architecture: the registry's nvidia-nccl-cu13 2.32.3 wheel carries a 344 MB libnccl.so.2 (every
# architecture), over what fits beside a job on a machine that cannot download. One architecture is far smaller
# (the size is printed at the end, and written to .nccl/BUILD).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
tag=${NCCL_TAG:-v2.30.7-1}
src=${NCCL_SRC:-https://github.com/NVIDIA/nccl.git}
arch=${NCCL_ARCH:-90}
out=${NCCL_OUT:-$here/.nccl}
jobs=${JOBS:-$(nproc)}
cuda=${CUDA_HOME:-/usr/local/cuda}
# Only the kernels torch's NCCL backend launches for this engine (every collective is a SUM all-reduce,
# a SUM reduce-scatter, an all-gather, a broadcast or a send/recv, of fp32, bf16, fp64 (the step's
# metrics) or integers; NCCL_ONLY_FUNCS= builds them all): the device code is most of the build (30-120 s
# of a core per generated file, 132 files in all). A collective outside the set fails with NCCL's error.
only=${NCCL_ONLY_FUNCS-'AllReduce Sum (f32|bf16|f64|u8|u64|i64) * *|ReduceScatter Sum (f32|bf16) * *|AllGather * *|Broadcast * *|SendRecv'}

[ -x "$cuda/bin/nvcc" ] || { echo "build.sh: no nvcc under CUDA_HOME=$cuda (set CUDA_HOME)" >&2; exit 2; }
work="$out/src"
if [ ! -d "$work/.git" ]; then
  rm -rf "$work"; mkdir -p "$out"
  git clone --quiet "$src" "$work"
fi
git -C "$work" checkout --quiet "$tag"
start=$(date +%s)
make -C "$work" -j"$jobs" src.build CUDA_HOME="$cuda" ONLY_FUNCS="$only" \
  NVCC_GENCODE="-gencode=arch=compute_${arch},code=sm_${arch}" BUILDDIR="$out/build" >"$out/build.log" 2>&1 \
  || { tail -30 "$out/build.log" >&2; echo "build.sh: make failed, log in $out/build.log" >&2; exit 1; }
mkdir -p "$out/lib"
lib=$(readlink -f "$out/build/lib/libnccl.so")
cp "$lib" "$out/lib/libnccl.so.2"
strip --strip-unneeded "$out/lib/libnccl.so.2"
size=$(stat -c %s "$out/lib/libnccl.so.2")
printf 'tag=%s\narch=sm_%s\nonly_funcs=%s\ncuda=%s\nbytes=%s\nbuild_s=%s\n' "$tag" "$arch" "$only" \
  "$("$cuda/bin/nvcc" --version | tail -1)" "$size" "$(( $(date +%s) - start ))" | tee "$out/BUILD"
echo "LD_PRELOAD=$out/lib/libnccl.so.2"
