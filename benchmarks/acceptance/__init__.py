"""GPU acceptance: one command that checks the engine on one GPU, and the same code path on a CPU.

    python benchmarks/gpu_acceptance.py [--device cuda|cpu] [--out PATH] [--only a,b,...]

Written for one H100 (at most 25 minutes, `--device cuda`, bf16, slices of the 1.3B GPT shape, or
of Llama 3.2 1B with `--family llama`) and runnable on a 2-core CPU machine in under 2 minutes
(`--device cpu`, fp32, the `tiny` preset), so that the script itself is tested where no GPU is at hand (tests/benchmarks/test_gpu_acceptance.py).
Writes one JSON file (benchmarks/results/gpu_acceptance.json by default), prints a table, and exits
with 1 if any section failed (a skipped section, with its reason, does not fail the run).

Every section is independent: it runs in a process of its own (a CUDA error that sticks to a
context, an NCCL abort that crashes a process or a hang stays there), bounded by `--section-timeout`;
its error is recorded in the JSON (message and traceback, or a hung process's stacks) and the other
sections still run. The JSON is rewritten after every section. `--only a,c` runs a subset.

a  abort_rebuild   Training through the engine's real `Worker` on a one-rank plan from the planner
                   (engine/from_planner.py), on a real generation over a TCPStore (abort.py's
                   build_generation: NCCL on a GPU, gloo on the CPU). Twice the coordinator's key
                   `gen{g}/failed` arrives at a step's commit point (its last wait): the step must
                   leave with GenerationAborted, pending and not applied (on NCCL the generation's
                   communicators are aborted); then, as elastic_process.run_generation does,
                   recovery.reach_step to the coordinator's resume step, generation g+1 built in the
                   same process, the old one released, the layers kept from memory. The first time a
                   survivor had finished the step (resume at s+1: the pending step is completed with
                   no peer), the second time nobody had (resume at s: it is dropped and replayed).
                   The final parameters and optimizer state must be bitwise those of an identical
                   worker that trained the same steps without a failure (torch.equal on every
                   tensor), and so must every loss. A second uninterrupted run is the control: if it
                   differs from the first, the device is not reproducible and the comparison says
                   nothing about recovery (so the job sets `training.deterministic`, as a recipe
                   can: deterministic kernels, not warn-only, and cuBLAS's fixed workspace; on the
                   first H200 run, warn-only, cuDNN's attention backward made two runs differ).
b  throughput      tokens/s and MFU (6 * params * tokens/s / peak dense bf16 FLOP/s of
                   planning/gpus.py, "unknown" elsewhere) of the engine's step (Worker.train_step on
                   a one-stage plan: Stage forward/backward, abortable waits, per-layer optimizers)
                   against a plain PyTorch loop over the same layers and batches (torch.optim.AdamW
                   defaults), plain + fused AdamW (torch's fused kernel, CUDA or CPU), and plain +
                   fused AdamW + torch.compile (in a child process bounded by `--compile-budget`; a
                   compile that fails or overruns is skipped with its reason). Medians over timed
                   steps after warm-up, synchronised on CUDA; ratios engine / each reference.
c  memory          Peak bytes per step above a baseline taken before the layers exist
                   (oobleck_slurm/peak_memory.py: torch.cuda.max_memory_allocated on a GPU; on a CPU the
                   peak RSS, with glibc returning freed memory to the OS, which needs tensors of
                   >= 64 KiB: a wider model there, `--memory-d-model`), in a fresh process: the
                   engine's worker, the same worker with the pre-step copy the engine used to keep
                   (StepUndo, now replaced by completing pending steps: emulated, `PreStepCopy`), and
                   the plain loop (the overhead of the machinery), against the planner's stage memory
                   (cost.stage_memory, with the estimated profile and one measured here by
                   planning/measure.py profile_model; + parameter
                   and optimizer bytes for the copy). Checked where the probe counts tensors (CUDA):
                   the worker fits the budget the planner plans with (prediction / 0.9).
d  copy_bandwidth  GB/s of GPU -> pinned host, pinned host -> GPU (and pageable), GPU -> GPU on one
                   device (`--copy-mb`, 256 MB on a GPU), and the host's memcpy. On a CPU only the
                   memcpy; the others are skipped ("no GPU").
e  two_ranks_one_gpu  Two processes each build an NCCL group of 2 on cuda:0 through comm.make_group
                   (NCCL before 2.30 refuses: "Duplicate GPU detected"), then once more with
                   NCCL_MULTI_RANK_GPU_ENABLE=1. Passes if every process exits, with an error or not,
                   within `--child-timeout` (a clear error, not a hang); the messages are recorded.
                   Skipped on a CPU ("no GPU").
f  two_stage_pipeline  Two processes, a 2-stage pipeline from the planner through Worker + generation
                   on the job's signed store (NCCL's rendezvous through it), several microbatches
                   (1F1B, where NCCL p2p can deadlock), ~50 MB of activations per microbatch on a
                   GPU; needs 2 GPUs, or one GPU with an NCCL that accepts
                   NCCL_MULTI_RANK_GPU_ENABLE=1 (>= 2.30), else skipped with the reason. On a CPU the
                   same pipeline with tiny shapes twice: on plain gloo (a CPU job's groups) and on
                   gloo under NCCL's ordering rules (OOBLECK_NCCL_ORDER=1, engine/nccl_order.py).
                   Passes if both ranks exit 0 within the bound and the trained state is bitwise that
                   of a one-stage run of the same steps (the engine detaches at every layer boundary,
                   so cutting the layers into stages changes no arithmetic). A hung child's Python
                   stacks are recorded (faulthandler on SIGUSR1 before it is killed).

The environment (torch, CUDA, NCCL, device, memory) is recorded. Section h is `submit`'s own kill drill.
NCCL children get the environment a node agent gives its workers (agent/main.py NCCL_WORKER_ENV).
"""
