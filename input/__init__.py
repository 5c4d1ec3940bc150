"""Input pipelines (installed as ``hybridpar.input``): host-local numpy batches per process."""

import os

# TensorFlow (tf.data only) logs its CPU-feature and oneDNN banners at start; keep warnings.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TF 2.21 logs the oneDNN banner before it reads that level. oneDNN's kernels are convolutions
# and matmuls, which tf.data's decode and augment do not run (measured: same images/s off).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
