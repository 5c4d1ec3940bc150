"""`python -m hybridpar.simulate`: see hybridpar/simulate/cli.py."""

from __future__ import annotations

import sys

from hybridpar.simulate.cli import main

if __name__ == "__main__":
    sys.exit(main())
