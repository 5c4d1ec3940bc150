"""``python -m hybridpar.report``: the command ``hybridpar.tools.report``."""

from hybridpar.tools.report import main

if __name__ == "__main__":
    main()
