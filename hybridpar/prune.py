"""``python -m hybridpar.prune``: the command ``hybridpar.tools.prune``."""

from hybridpar.tools.prune import main

if __name__ == "__main__":
    main()
