"""A run: set-up, the training loop, checkpoints, the workdir lock, records,
the evaluator, saved executables and the distillation teacher."""
