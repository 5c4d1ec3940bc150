"""``python -m hybridpar.train --config experiments/NAME.py --workdir DIR [--config.KEY=VALUE]``.

One linear ``train_and_evaluate`` in banner-commented sections, in the order data flows:
config -> mesh and rules -> data -> model, optimizer and sharded state -> compiled steps ->
loop (metrics) -> summary. Bad config or input stops with one ``error:`` line that names the
fix; no traceback.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from hybridpar import comm, partitioning
from hybridpar.config import load_config, validate
from hybridpar.errors import ConfigError
from hybridpar.input.datasets import make_data
from hybridpar.input.prefetch import prefetch_to_mesh
from hybridpar.mesh import describe_mesh, make_mesh
from hybridpar.metrics import MetricsWriter
from hybridpar.program import build_program, check_batch_sizes
from hybridpar.state import init_sharded

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, summary and events.")


def log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


def check_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, ".write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(
            f"workdir {workdir!r} is not writable ({e.strerror}); pass a --workdir you can write to"
        ) from None


def memory_line(compiled) -> tuple[str, dict]:
    m = compiled.memory_analysis()
    if m is None:
        return "per-device memory of the train step: not reported by this backend", {}
    fields = dict(
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        temp=m.temp_size_in_bytes,
        aliased=m.alias_size_in_bytes,
    )
    total = fields["arguments"] + fields["outputs"] + fields["temp"] - fields["aliased"]
    fields["total"] = total
    mib = {k: v / 2**20 for k, v in fields.items()}
    return (
        "per-device memory of the train step: {total:.1f} MiB (arguments {arguments:.1f}, "
        "outputs {outputs:.1f}, temp {temp:.1f}, donated/aliased {aliased:.1f})".format(**mib),
        fields,
    )


def train_and_evaluate(config, workdir: str) -> dict:
    start = time.time()
    validate(config)
    check_workdir(workdir)
    comm.apply(config.comm)  # XLA's collective flags must be set before the backend starts
    if config.distributed:
        jax.distributed.initialize()
    pi, pc = jax.process_index(), jax.process_count()

    # ---- Mesh and placement rules ----------------------------------------------------------
    mesh = make_mesh(config.mesh)
    check_batch_sizes(config, mesh)
    log(describe_mesh(mesh))

    # ---- Data --------------------------------------------------------------------------------
    data = make_data(config, pi, pc)
    spe, image_shape = data.steps_per_epoch, data.image_shape
    total_steps = max(int(round(config.num_epochs * spe)), 1)
    eval_every = max(int(round(config.eval_every_epochs * spe)), 1)

    # ---- Model, optimizer and sharded state --------------------------------------------------
    program = build_program(config, mesh, image_shape, spe, total_steps)
    state = init_sharded(program.init, program.shardings, jax.random.key(config.seed))
    log(
        "parameter and optimizer-state placement:\n"
        + partitioning.sharding_table(program.shardings, program.abstract)
    )

    # ---- Steps, compiled ahead of the loop ---------------------------------------------------
    t0 = time.time()
    train_step = program.lower_train(config.global_batch).compile()
    eval_step = program.lower_eval(config.eval_batch).compile()
    compile_s = time.time() - t0
    mem_text, mem = memory_line(train_step)
    log(mem_text)

    writer = MetricsWriter(workdir, start)
    writer.write("data", 0, 0.0, **data.info)
    writer.write("compile", 0, 0.0, compile_s=round(compile_s, 3), memory_per_device_bytes=mem)
    log(
        f"compiled train and eval steps in {compile_s:.1f}s; training {total_steps} steps "
        f"({config.num_epochs:g} epochs of {spe}), global batch {config.global_batch}"
    )

    # ---- Loop ----------------------------------------------------------------------------------
    def evaluate(step):
        sums = None
        for batch in prefetch_to_mesh(data.eval_batches(), mesh, config.data.prefetch):
            out = eval_step(state, batch)
            sums = out if sums is None else jax.tree.map(lambda a, b: a + b, sums, out)
        sums = jax.device_get(sums)
        n = float(sums["count"])
        if round(n) != data.num_eval:
            raise AssertionError(f"eval counted {n} examples, expected {data.num_eval}")
        rec = writer.write(
            "eval",
            step,
            step / spe,
            split="test",
            loss=float(sums["loss_sum"]) / n,
            top1=float(sums["top1_sum"]) / n,
            top5=float(sums["top5_sum"]) / n,
            examples=int(n),
        )
        log(
            f"eval  step {step:>6}  epoch {step / spe:6.2f}  loss {rec['loss']:.4f}  "
            f"top1 {rec['top1']:.4f}  top5 {rec['top5']:.4f}  ({int(n)} examples)"
        )
        return rec

    step, last_eval, time_to_target, failure = 0, None, None, None
    pending, t_log, steps_at_log = [], time.time(), 0
    train_time, images_seen = 0.0, 0
    try:
        while step < total_steps:
            epoch = step // spe
            batches = data.train_batches(epoch, start_step=step - epoch * spe)
            for batch in prefetch_to_mesh(batches, mesh, config.data.prefetch):
                state, metrics = train_step(state, batch)
                pending.append(metrics)
                step += 1
                now = time.time()
                is_eval = step % eval_every == 0 or step == total_steps
                if now - t_log >= config.log_every_s or is_eval:
                    fetched = jax.device_get(pending)  # waits for the steps: honest timing
                    now = time.time()
                    loss = float(np.mean([f["loss"] for f in fetched]))
                    if not math.isfinite(loss):
                        raise ConfigError(
                            f"non-finite loss ({loss}) at step {step}: the run diverged; lower "
                            "optim.base_lr, add warmup (optim.warmup_epochs), or use bfloat16 / "
                            "float16 with loss scaling instead of pure low precision"
                        )
                    dt = now - t_log
                    ips = (step - steps_at_log) * config.global_batch / dt
                    train_time += dt
                    images_seen += (step - steps_at_log) * config.global_batch
                    eta = (total_steps - step) * dt / (step - steps_at_log)
                    skipped = sum(not bool(f["grads_finite"]) for f in fetched)
                    writer.write(
                        "train",
                        step,
                        step / spe,
                        loss=loss,
                        lr=float(fetched[-1]["lr"]),
                        images_per_s=round(ips, 2),
                        image_size=image_shape[0],
                        global_batch=config.global_batch,
                        skipped_steps=skipped,
                        loss_scale=float(fetched[-1]["loss_scale"]),
                    )
                    log(
                        f"train step {step:>6}/{total_steps}  epoch {step / spe:6.2f}  "
                        f"loss {loss:.4f}  {ips:8.1f} img/s  ETA {eta:6.0f}s"
                    )
                    pending, t_log, steps_at_log = [], time.time(), step
                if is_eval:
                    last_eval = evaluate(step)
                    if (
                        time_to_target is None
                        and config.target_top1 > 0
                        and last_eval["top1"] >= config.target_top1
                    ):
                        time_to_target = {
                            "wall_s": last_eval["wall_s"],
                            "step": step,
                            "epoch": step / spe,
                            "top1": last_eval["top1"],
                        }
                    t_log = time.time()  # eval time is not training throughput
                if step >= total_steps:
                    break
    except BaseException as e:  # recorded in the summary, then raised as it was
        failure = f"{type(e).__name__}: {e}"
        raise
    finally:
        summary = {
            "mesh": dict(mesh.shape),
            "steps": step,
            "total_steps": total_steps,
            "completed": failure is None and step >= total_steps,
            "error": failure,
            "final_eval": last_eval,
            "wall_s": round(time.time() - start, 3),
            "compile_s": round(compile_s, 3),
            "train_images_per_s": round(images_seen / train_time, 2) if train_time else None,
            "target_top1": config.target_top1 if config.target_top1 > 0 else None,
            "time_to_target": time_to_target,
            "memory_per_device_bytes": mem,
        }
        writer.summary(summary)
        writer.close()
    return summary


def config_from_flags():
    """The --config value, or one ``error:`` line and exit 2 when it is missing or broken."""
    if _CONFIG.value is None:
        print("error: pass --config experiments/NAME.py", file=sys.stderr)
        sys.exit(2)
    try:
        config = _CONFIG.value
        config.to_dict()  # config_flags loads lazily: a missing or broken file raises here
    except OSError as e:
        print(f"error: could not load the config file: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    return config


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not _WORKDIR.value:
        print("error: pass --config experiments/NAME.py and --workdir DIR", file=sys.stderr)
        sys.exit(2)
    config = config_from_flags()
    try:
        summary = train_and_evaluate(config, _WORKDIR.value)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    ev = summary["final_eval"] or {}
    log(
        f"done: top1 {ev.get('top1', float('nan')):.4f} in {summary['wall_s']:.1f}s "
        f"(compile {summary['compile_s']:.1f}s); summary in {_WORKDIR.value}/summary.json"
    )


def _config_keys(path: str) -> list[str]:
    """Every dotted key of the config file named by --config (for "did you mean")."""
    try:
        cfg = load_config(path)
    except Exception:  # the file itself is broken: absl's message says why
        return []
    keys = []

    def walk(d, prefix):
        for k, v in d.items():
            keys.append(prefix + k)
            if hasattr(v, "items"):
                walk(v, prefix + k + ".")

    walk(cfg, "")
    return keys


def _parse_flags(argv):
    """absl's parser, but a misspelt --config.KEY gives one line naming the fix."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        config_path = next(
            (a.split("=", 1)[1] for a in argv if a.startswith("--config=")),
            argv[argv.index("--config") + 1] if "--config" in argv else None,
        )
        keys = _config_keys(config_path) if config_path else []
        bad = [
            a.split("=", 1)[0][len("--config.") :]
            for a in argv
            if a.startswith("--config.") and a.split("=", 1)[0][len("--config.") :] not in keys
        ]
        if keys and bad:
            import difflib

            hints = []
            for key in bad:
                close = difflib.get_close_matches(key, keys, n=3)
                hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                hints.append(f"no config key {key!r}{hint}")
            print(
                f"error: {'; '.join(hints)} (keys are set as --config.KEY=VALUE; see "
                f"{config_path} and hybridpar/config.py for the valid ones)",
                file=sys.stderr,
            )
        else:
            print(f"error: bad --config override: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)


def run():
    """Console-script entry point (``hybridpar-train``)."""
    # jax logs at INFO that it found no TPU; that is noise on every CPU and GPU machine.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
