from oobleck_slurm.cli import main

raise SystemExit(main())
