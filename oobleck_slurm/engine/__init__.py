"""Training engine: heterogeneous pipeline replicas on torch.distributed.

Pure logic (no processes, no I/O):
    layout      ExecPlan (pipelines, stages, microbatch slices) and each rank's role in it
    schedule    the 1F1B action list of one stage
    lr          learning-rate warmup + decay
    spec        JobSpec: model, data, optimizer and training settings as JSON for worker processes
Runtime:
    comm        Generation: every process group of one membership generation, every timeout named
    stage       a stage's forward/backward over its layers, one layer boundary at a time
    transfer    moving a layer's parameters and optimizer state between ranks (plan changes)
    worker      Worker: one process's training loop with explicit, rebuildable state
    reference   single-process reference training on the same global batches
    launch      train_local: a TCPStore host process plus N worker processes on this machine
"""
