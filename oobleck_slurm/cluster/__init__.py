"""What a job is on disk and on the cluster, below the supervisor and the commands.

    jobdir    the job folder: every file name in it, the per-job secret, finding a job by name
    slurm     every Slurm command (srun, sbatch through submitit, scontrol, squeue, sacct, scancel)
              and the parameters of the jobs submitted (the allocation, replacement nodes)
"""
