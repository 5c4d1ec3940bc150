"""Input pipelines (installed as ``hybridpar.input``): host-local numpy batches per process."""

import os

# TensorFlow (tf.data only) logs its CPU-feature and oneDNN banners at start; keep warnings.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
