"""``python -m hybridpar.tune``: the command ``hybridpar.tools.tune``."""

from hybridpar.tools.tune import main

if __name__ == "__main__":
    main()
