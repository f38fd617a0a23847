from oobleck_slurm.cli import main

# The guard matters: multiprocessing's spawn re-imports __main__ in every child process.
if __name__ == "__main__":
    raise SystemExit(main())
