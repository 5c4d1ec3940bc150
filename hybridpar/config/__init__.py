"""The run's configuration, parsed and checked without JAX: the schema, the
command line, errors, the curriculum and the learning-rate schedules."""
