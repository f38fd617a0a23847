"""Cluster backends: Slurm (through submitit and Slurm's clients) and local virtual nodes."""
