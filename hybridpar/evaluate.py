"""``python -m hybridpar.evaluate``: the command ``hybridpar.tools.evaluate``."""

from hybridpar.tools.evaluate import main

if __name__ == "__main__":
    main()
