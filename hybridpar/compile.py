"""``python -m hybridpar.compile``: the command ``hybridpar.tools.compile``."""

from hybridpar.tools.compile import main

if __name__ == "__main__":
    main()
