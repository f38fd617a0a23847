"""GPU acceptance: one command that checks the engine on one GPU, and the same code path on a CPU.

    python benchmarks/gpu_acceptance.py [--device cuda|cpu] [--out PATH] [--only a,b,...]

The entry point only: the sections live in benchmarks/acceptance/ (one module per section, a_... to
h_..., what they share in harness.py and references.py, the command in runner.py; the package's
docstring is `--help`). Every child process (a section, a rank) is started through this file again,
`--_child KIND CONFIG`, so that scripts and docs keep one command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder is already first on sys.path; imported some other way, it is not.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance.runner import child_main, main  # noqa: E402  (benchmarks/acceptance/, after the path)

if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_child":
        raise SystemExit(child_main(sys.argv[2], sys.argv[3]))
    raise SystemExit(main())
