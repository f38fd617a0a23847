"""Training engine: heterogeneous pipeline replicas on torch.distributed.

Pure logic (no processes, no I/O):
    layout      ExecPlan (pipelines, stages, microbatch slices) and each rank's role in it
    schedule    the 1F1B action list of one stage
    lr          learning-rate warmup + decay
    spec        JobSpec: model, data, optimizer and training settings as JSON for worker processes
Runtime:
    comm        Generation: every process group of one membership generation, every timeout named
    stage       a stage's forward/backward over its layers, one layer boundary at a time
    layer_rng   random layers' draws seeded per (step, microbatch, layer): dropout whatever the plan
    transfer    moving a layer's parameters and optimizer state between ranks (plan changes)
    worker      Worker: one process's training loop with explicit, rebuildable state
    batches     a job's data in a worker: the samples of each step, `Reads` (what a rank reads)
    prefetch    Prefetcher: the next step's reads in a thread, used only for the key they were made for
    abort       abortable generations: waits that leave as soon as the coordinator fails a generation
    recovery    step undo (an optimizer step everywhere or nowhere)
    from_recipe the recipe's tokens and JobSpec; from_planner: the planner's Plan as an ExecPlan
    elastic_process  the worker process an agent starts, one per device
    faults      fault injection for drills and tests: the checked faults list, hooks the worker calls
"""
