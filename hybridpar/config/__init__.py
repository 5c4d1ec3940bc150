"""The JAX-free base layer: the run's configuration, parsed and checked (the schema, the
command line, errors, the curriculum and the learning-rate schedules), and the facts and
rules every layer may read (the accelerator table, how sizes, times and tables print)."""
