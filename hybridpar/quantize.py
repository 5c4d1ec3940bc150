"""``python -m hybridpar.quantize``: the command ``hybridpar.tools.quantize``."""

from hybridpar.tools.quantize import main

if __name__ == "__main__":
    main()
