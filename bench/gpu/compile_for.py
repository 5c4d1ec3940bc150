"""Compiled-program files on the GPU machine where ``python -m hybridpar.compile`` does not
reach yet (bench/gpu/e2e.py's section (d) tries the tool itself first).

    python bench/gpu/compile_for.py aot    --config ... --target gpu:h100-1 --out FILE --json
    python bench/gpu/compile_for.py device --config ... --out FILE

``aot``: the compile tool itself, with jax's CUDA 13 plugin accepted as the GPU compiler
(``targets.have_cuda_plugin`` looks for the CUDA 12 one, the ``gpu-aot`` extra; the GPU
image has CUDA 13's): the device described, not used, as on a machine without a GPU.
``device``: the trainer's own set-up without data on this machine's devices (as the compile
tool's set-up), every stage's train step and the eval step compiled there, and
``executables.save``; prints the compile tool's ``--json`` fields that e2e.py reads
(``programs`` with their per-device ``memory``, ``largest``, ``wall_s``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time


def aot(argv) -> None:
    from hybridpar.tools import targets

    cuda12 = targets.have_cuda_plugin
    targets.have_cuda_plugin = lambda: cuda12() or (
        importlib.util.find_spec("jax_plugins") is not None
        and importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    )
    from hybridpar.tools import compile as tool

    tool.main(argv)


def device(argv) -> None:
    import copy

    from hybridpar.config import cli
    from hybridpar.runtime import executables

    parser = cli.ArgumentParser(
        "compile_for.py device", "The run's programs compiled on this GPU, saved to --out."
    )
    parser.add_argument("--out", required=True)
    args, config = cli.parse(parser, argv)

    def run():
        from hybridpar.runtime.run import setup

        t0 = time.time()
        c = config
        size = executables.data_size(c)
        if size is not None and size != c.data.train_examples:  # plan as the run will
            c = copy.deepcopy(c)
            c.data.train_examples = size
        r = setup(c, with_data=False)
        p = r.program
        for st in r.plan.stages:
            p.train_step(st.stage.global_batch, st.stage.image_size)
        p.eval_step(c.eval_batch, c.data.image_size)
        executables.save(args.out, p, "device")
        rows = [{"program": rec["program"], "batch": rec["batch"],
                 "image_size": rec["image_size"], "compile_s": rec["compile_s"],
                 "memory": rec["memory_per_device_bytes"]} for rec in p.compiles]  # fmt: skip
        big = max(rows, key=lambda x: x["memory"].get("total", 0))
        print(json.dumps({"out": args.out, "target": "device", "programs": rows,
                          "largest": f"{big['program']} (batch {big['batch']}, "
                          f"{big['image_size']} px)", "wall_s": round(time.time() - t0, 3)}))

    cli.main(run)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("aot", "device"):
        sys.exit("usage: compile_for.py aot|device --config ... [--target ...] --out FILE")
    {"aot": aot, "device": device}[sys.argv[1]](sys.argv[2:])
