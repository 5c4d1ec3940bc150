"""``python -m hybridpar.comm_report``: the command ``hybridpar.tools.comm_report``."""

from hybridpar.tools.comm_report import main

if __name__ == "__main__":
    main()
