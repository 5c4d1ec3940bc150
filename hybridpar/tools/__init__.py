"""One module per command (train, evaluate, compile, comm_report, plan, tune,
report, quantize, prune, compress) and the compile targets."""
