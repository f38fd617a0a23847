"""What runs on each node beside the workers; the supervisor starts it and talks to it by messages.

    main        the node agent (`python -m oobleck_slurm.agent.main JOB_DIR`): registers, beats,
                starts and stops the node's workers, runs health checks and drills
    health      the node's metrics, sampled and sent in batches; the `slow` and `leak` drills
    warm        warm servers: a process that has imported torch and the engine forks workers
    preflight   a joining node's side of the check before it joins (a collective with the supervisor)

It imports `protocol/`, `cluster/` and the engine, never `supervisor/` (docs/architecture.md).
"""
