"""Input pipelines (installed as ``hybridpar.input``): host-local numpy batches per process."""
