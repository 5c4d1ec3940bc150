"""Runs the peer ``airbench94.py`` (Keller Jordan's airbench, PyTorch) on given CIFAR-10 pixels.

    python bench/gpu/airbench_peer.py --peer bench/gpu/peers/airbench94.py \
        --npz WORK/cifar10_uint8.npz --work WORK/airbench --runs 3 --budget-s 90 --json OUT

The peer is not ours and is not committed: bench/gpu/e2e.py's ``--prepare`` says where it
comes from, and it is carried to the GPU machine in the ignored ``bench/gpu/peers/``. Its
loader reads ``cifar10/train.pt`` and ``cifar10/test.pt`` under the working directory (a
dict of uint8 images N x 32 x 32 x 3, int64 labels and the class names), downloading
CIFAR-10 with torchvision when they are absent. Here they are written from ``--npz`` (the
JPEG tars decoded with Pillow, the pixels hybridpar trains on) before the peer starts, so
nothing is downloaded and both train on the same images.

The peer's module is imported, not run as a script (its ``__main__`` trains 25 times): one
``main('warmup')`` (random labels, as its own warmup: cuDNN's autotuning happens there),
then ``main(i)`` for i = 0.. while the budget lasts, at most ``--runs``. Each run's time is
the peer's own clock (CUDA events around the whitening init, the training epochs and the
final test-time-augmented eval; not its per-epoch evals) and its accuracy the TTA top-1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


def write_cache(npz: str, folder: str) -> dict:
    """``folder/train.pt`` and ``test.pt`` in the peer loader's format, from ``npz``."""
    import numpy as np
    import torch

    os.makedirs(folder, exist_ok=True)
    z = np.load(npz)
    classes = [str(c) for c in z["classes"]]
    out = {}
    for split in ("train", "test"):
        images = torch.from_numpy(np.ascontiguousarray(z[f"{split}_image"]))
        labels = torch.from_numpy(z[f"{split}_label"].astype(np.int64))
        torch.save({"images": images, "labels": labels, "classes": classes},
                   os.path.join(folder, f"{split}.pt"))  # fmt: skip
        out[split] = int(len(labels))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", required=True)
    p.add_argument("--npz", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=90.0)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    t0 = time.time()
    rec = {"runs": [], "note": ""}

    def save():
        with open(a.json + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(a.json + ".tmp", a.json)

    import torch

    rec["torch"] = torch.__version__
    if not torch.cuda.is_available():
        rec["note"] = "no CUDA device for torch: airbench94 needs one"
        save()
        return 0
    rec["device"] = torch.cuda.get_device_name()
    rec["examples"] = write_cache(a.npz, os.path.join(a.work, "cifar10"))
    os.chdir(a.work)  # the peer's loader reads ./cifar10/{train,test}.pt
    spec = importlib.util.spec_from_file_location("airbench94", os.path.abspath(a.peer))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    finals = []
    shown = peer.print_training_details

    def capture(variables, is_final_entry):
        if is_final_entry:
            finals.append(
                {k: float(variables[k]) for k in ("tta_val_acc", "total_time_seconds")}
            )
        return shown(variables, is_final_entry)

    peer.print_training_details = capture
    peer.print_columns(peer.logging_columns_list, is_head=True)
    w0 = time.time()
    peer.main("warmup")
    rec["warmup_wall_s"] = round(time.time() - w0, 2)
    save()
    last = rec["warmup_wall_s"]
    for i in range(a.runs):
        if time.time() - t0 + last > a.budget_s:
            rec["note"] = f"stopped after {i} run(s): the next would pass --budget-s {a.budget_s:g}"
            break
        r0 = time.time()
        peer.main(i)
        last = time.time() - r0
        rec["runs"].append(dict(finals[-1], wall_s=round(last, 2)))
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
