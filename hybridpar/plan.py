"""``python -m hybridpar.plan``: the command ``hybridpar.tools.plan``."""

from hybridpar.tools.plan import main

if __name__ == "__main__":
    main()
