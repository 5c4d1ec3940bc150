"""``python -m hybridpar.train``: the command ``hybridpar.tools.train``."""

from hybridpar.tools.train import main

if __name__ == "__main__":
    main()
