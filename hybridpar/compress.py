"""``python -m hybridpar.compress``: the command ``hybridpar.tools.compress``."""

from hybridpar.tools.compress import main

if __name__ == "__main__":
    main()
