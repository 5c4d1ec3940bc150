"""``python -m hybridpar.compile --config experiments/NAME.py --target tpu:v5e-16 [--json]``

Compiles every program a run would compile, each curriculum stage's train step and the eval
step, for a target without running anything: the TPU compiler itself for ``tpu:...``
targets (libtpu's ahead-of-time path, on a machine with no TPU: ``hybridpar/tools/targets.py``),
or XLA:CPU on N virtual devices for ``cpu:N``. The set-up is the trainer's own
(``hybridpar.runtime.run.setup`` without data, on the target's devices), so the programs are the
ones the run will execute on that hardware.

For each program: per-chip memory (arguments, outputs, temporaries, and the total against
the chip's HBM), FLOPs and bytes accessed by the compiler's count, every collective as
the compiler scheduled it (kind, bytes, groups, asynchronous or not) and what each
overlaps: the compute scheduled between its start and done, and the bytes overlapped and
exposed (a synchronous collective, or one with nothing between, is exposed), an estimate of
the bytes that compute hides (its FLOPs at the chip's peak against the collective's time on
the target's links as ``simulate`` prices it: ``comm_report.hidden_on_target``; none where
those links have no price), compile time, and a
bound on the step time, its FLOPs at the chip's peak (no step is faster; memory traffic,
collectives, launch and input not counted), with the most images/s per chip it allows. The
bytes accessed at HBM bandwidth are in the JSON (``bytes_accessed_s``) but bound nothing:
XLA's count is more than the HBM traffic (``targets.bytes_accessed_s``). XLA counts a loop's
body once, whatever its trips: a program with loops of convolutions or dots (the TPU
compiler's windowed einsums on an ``fsdp`` mesh) computes more than its FLOP count
(``flop_loops``: how many such loops), and its bound is looser.
A program that does not fit the chip's HBM (the TPU compiler refuses it) is one ``error:``
line naming its need, the capacity and a plan that compiles. The last line is
``key=value`` figures for the largest program.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import Counter

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.config.formatting import byte_size
from hybridpar.tools import targets

# Nothing above imports JAX: ``--target`` sets the environment before the backend starts.

OVERLAP_LINES = 6  # per program in the text report, those moving the most bytes first


def compile_programs(
    config, target: targets.Target, out: str | None = None, show=None, say=None,
    overwrite: bool = False,
) -> dict:  # fmt: skip
    """Every stage's train step and the eval step compiled for ``target``; the report as
    a dict (``programs``, the ``largest`` by memory, the target and mesh). ``out``: a file
    the executables are written to, for ``train --compiled`` (checked before compiling; one
    there already is an error unless ``overwrite``). ``show``: called with the report before
    the file is written, so a failed write loses no report. ``say``: called with a line as
    each program starts compiling (a large model's take minutes each)."""
    from hybridpar.runtime import executables

    say = say or (lambda line: None)
    if not out:
        return _compile_programs(config, target, out, show, say)
    executables.check_out(out)
    if os.path.exists(out) and not overwrite:
        written = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(out)))
        raise ConfigError(f"--out {out} exists (written {written}): pass --overwrite to replace "
                          "it, or move it away first")  # fmt: skip
    # An executable JAX loaded from its persistent cache serializes without its functions
    # (jax 0.10.2, XLA:CPU: "NOT_FOUND: Function wrapped_add not found" at the loading run's
    # first step), so a compile for --out never reads that cache.
    from hybridpar.program import compile_cache

    with compile_cache.bypassed():
        return _compile_programs(config, target, out, show, say)


def program_row(kind: str, batch: int, size: int, rec: dict, hlo: str, cost: dict,
                target: targets.Target) -> dict:  # fmt: skip
    """One program's row of the report from its compile record (``program.compiles``), its
    compiled HLO text and its cost (``comm_report.cost_of``)."""
    from hybridpar.tools import comm_report

    collectives = comm_report.parse_collectives(hlo)
    events = comm_report.parse_overlap(hlo)
    est = comm_report.hidden_of(events, target)  # None: the links have no price
    overlap = [dict(e, text=comm_report.describe_overlap(e)) for e in events]
    for e, x in zip(overlap, est or ()):  # hidden or only overlapped: compute vs link time
        e.update(_hidden(e, x))
    step_s = targets.flops_bound_s(target, cost["flops"])
    # the eval step's too: its batch is the images a step, as the train step's
    per_chip = batch / target.devices_count
    return dict(
        program=kind,
        batch=batch,
        image_size=size,
        compile_s=rec["compile_s"],
        memory=rec["memory_per_device_bytes"],
        **cost,
        collective_ops=sum(r["count"] for r in collectives),
        collective_bytes=sum(r["total_bytes"] for r in collectives),
        async_collective_ops=sum(r["count"] for r in collectives if r["async"]),
        # the overlapped and exposed ops and bytes, and the estimates
        **comm_report.overlap_totals(events) | comm_report.schedule_figures_of(events, est),
        collectives=collectives,
        overlap=overlap,
        # XLA's FLOP count takes each of these loops' bodies once: the program computes more
        flop_loops=comm_report.loops_with_compute(hlo),
        flops_bound_step_s=step_s,
        max_images_per_s_per_chip=round(per_chip / step_s, 1) if step_s else None,
        bytes_accessed_s=targets.bytes_accessed_s(target, cost["bytes_accessed"]),
    )


def _compile_programs(config, target, out, show, say) -> dict:
    import copy

    from hybridpar.parallel.mesh import axes_across_slices
    from hybridpar.runtime import executables
    from hybridpar.runtime.run import check_epoch, programs_of
    from hybridpar.tools import comm_report

    t0 = time.time()
    size = executables.data_size(config)
    if size is not None and size != config.data.train_examples:
        # plan as the run will from the data itself, so its file fits without the flag
        config = copy.deepcopy(config)
        config.data.train_examples = size
    try:
        run = _setup_for(config, target)
    except ConfigError as e:
        if "devices but" in str(e):  # the mesh's size is not the target's
            msg = str(e).split(" (on CPU: XLA_FLAGS")[0]  # --target sets the CPU count here
            raise ConfigError(f"{msg} ({targets.target_hint(target, config.mesh)})") from None
        raise
    check_epoch(run)
    program = run.program
    wanted = programs_of(run)
    replacing = bool(out) and os.path.exists(out)
    rows = []
    for i, (kind, batch, size) in enumerate(wanted, 1):
        say(f"compiling {kind} b{batch} {size}px ({i}/{len(wanted)}) ...")
        compiled = _compile_or_explain(run, target, kind, batch, size)
        rec = program.compiles[-1]
        say(f"compiled {kind} b{batch} {size}px in {rec['compile_s']:.1f} s")
        cost = comm_report.cost_of(compiled)
        rows.append(program_row(kind, batch, size, rec, compiled.as_text(), cost, target))
    largest = max(rows, key=lambda r: r["memory"].get("total", 0))
    device = run.mesh.devices.flat[0]
    report = dict(
        out=out,
        replacing=replacing,
        target=target.spec or f"cpu:{target.devices_count}",
        target_description=target.describe(),
        hbm_bytes_per_chip=target.chip.hbm_bytes if target.chip else None,
        mesh=dict(run.mesh.shape),
        gradient_sync=program.sync.choice,
        kernel_gradients=kernel_gradients(config, device.platform),
        slices=target.slices,
        axes_across_slices=list(axes_across_slices(run.mesh)),
        # what the mesh was laid on, as the compiler saw it (a TPU target's: "tpu")
        device_platform=device.platform,
        device_kind=device.device_kind,
        programs=rows,
        largest=f"{largest['program']} (batch {largest['batch']}, {largest['image_size']} px)",
        wall_s=round(time.time() - t0, 3),
    )
    if show is not None:
        show(report)
    if out:
        executables.save(out, program, report["target"])
    return report


def kernel_gradients(config, platform: str) -> str:
    """Which form of the convolutions' kernel gradients the programs compute, where it is
    not the GPU's and TPU's: comm_report on virtual CPU devices compiles theirs, so its
    memory and traffic differ from these programs' (a run on the CPU computes this form)."""
    from hybridpar.models.im2col import use_im2col

    if not use_im2col(config.model.conv_grad, platform):
        return ""
    why = "auto on XLA:CPU" if config.model.conv_grad == "auto" else "im2col"
    return (
        f"kernel gradients in the im2col form (model.conv_grad={why}), as a run on these "
        "CPU devices computes them; comm_report --devices and a GPU or TPU use XLA's own "
        "(--config.model.conv_grad=xla compiles that)"
    )


def _hidden(e: dict, est: dict) -> dict:
    """A collective's ``comm_report.hidden_on_target`` estimate (the target chip's peak
    against its time as ``simulate`` prices it on the target's links), with the text saying
    it for an overlapped collective."""
    est = dict(est)
    if not e["exposed"]:
        est["text"] = (
            f"{e['text']}: est. {est['compute_s'] * 1e6:.3g} us of compute vs "
            f"{est['collective_s'] * 1e6:.3g} us on the links, "
            f"{byte_size(est['bytes_hidden'])} hidden"
        )
    return est


def _setup_for(config, target: targets.Target):
    """The run's set-up without data on the target's devices, its steps compiled with the
    options every compile for that target needs."""
    from hybridpar.runtime.run import setup

    run = setup(config, with_data=False, devices=target.devices())
    run.program.compiler_options = target.compiler_options()
    return run


def _compile_or_explain(run, target, kind: str, batch: int, size: int):
    """The program compiled; where it is over the chip's HBM (the TPU compiler refuses to
    compile it; a GPU program is checked after), one error naming the need, the capacity
    and a plan that does compile: the same batch with the state sharded over every chip
    (``fsdp``), else the largest smaller batch found on this mesh (each candidate compiled
    to check)."""
    try:
        return _step_within(run, target, kind, batch, size)
    except Exception as e:
        need = hbm_shortfall(e)
        if need is None:
            raise
    head = (
        f"the {kind} step (batch {batch}, {size} px) needs {byte_size(need[0])} of HBM per "
        f"chip on {target.spec} where {byte_size(need[1])} are available (the "
        f"{target.platform.upper()} compiler's count)"
    )
    fix = _fitting_mesh(run, target, kind, batch, size)
    fix = fix or _fitting_batch(run, target, kind, batch, size, need)
    raise ConfigError(f"{head}: {fix}" if fix else f"{head}; neither fsdp:-1 nor a smaller "
                      "batch compiles within it: use a chip with more HBM")  # fmt: skip


def _fitting_mesh(run, target, kind, batch, size) -> str | None:
    """``--config.mesh=fsdp:-1`` if the same program compiles within HBM on it."""
    import copy

    if run.mesh.shape.get("fsdp", 1) == run.mesh.size:
        return None
    config = copy.deepcopy(run.config)
    config.mesh = "fsdp:-1"
    try:
        other = _setup_for(config, target)
        _step_within(other, target, kind, batch, size)
    except Exception as e:
        if hbm_shortfall(e) is None and not isinstance(e, ConfigError):
            raise
        return None
    mem = other.program.compiles[-1]["memory_per_device_bytes"].get("total", 0)
    return f"--config.mesh=fsdp:-1 compiles it ({byte_size(mem)} per chip)"


def _fitting_batch(run, target, kind, batch, size, need, tries: int = 3) -> str | None:
    """The first of up to ``tries`` smaller batches (scaled by capacity over need, in
    multiples of the data-parallel size) that compiles within HBM on this mesh."""
    dp = run.plan.data_parallel
    trial = batch
    for _ in range(tries):
        trial = int(trial * need[1] / need[0] * 0.9) // dp * dp
        if trial < dp:
            return None
        try:
            _step_within(run, target, kind, trial, size)
        except Exception as e:
            if hbm_shortfall(e) is None:
                raise
            continue
        mem = run.program.compiles[-1]["memory_per_device_bytes"].get("total", 0)
        flag = batch_flag(run.config, dp, kind, batch, size, trial)
        return f"{flag} compiles on this mesh ({byte_size(mem)} per chip)"
    return None


def batch_flag(config, dp: int, kind: str, batch: int, size: int, trial: int) -> str:
    """The flag that makes the ``kind`` step of global batch ``batch`` at ``size`` px one of
    ``trial``: ``--config.eval_batch``, ``--config.global_batch``, or with stages the whole
    stage string with that stage's batch (per data-parallel device: ``trial / dp``) in it."""
    import re

    from hybridpar.config.curriculum import read_stages

    if kind == "eval":
        return f"--config.eval_batch={trial}"
    if not config.stages:
        return f"--config.global_batch={trial}"
    parts = [p.strip() for p in config.stages.split(",") if p.strip()]
    for i, (_, stage_size, per_device, *_) in enumerate(read_stages(config.stages)):
        if (stage_size, per_device * dp) == (size, batch):  # END:SIZE-BATCH[@SCALE][~M]
            parts[i] = re.sub(r"^([^-]*-\s*)\d+", rf"\g<1>{trial // dp}", parts[i])
    return f"--config.stages={','.join(parts)}"


def _step_within(run, target, kind: str, batch: int, size: int):
    """The step compiled, or the TPU compiler's out-of-memory error; the GPU compiler
    does not check device memory, so its programs are checked here, in the same words."""
    step = run.program.train_step if kind == "train" else run.program.eval_step
    compiled = step(batch, size)
    if target.platform == "gpu":
        over = over_capacity(run.program.compiles[-1]["memory_per_device_bytes"], target)
        if over:
            run.program.forget((kind, batch, size))  # not a usable program
            raise OverHbm(*over)
    return compiled


def over_capacity(memory: dict, target: targets.Target) -> tuple[int, int] | None:
    """``(needed, available)`` bytes where a program's per-device memory (``memory_of``:
    bytes) is over the target chip's capacity (bytes), else None. Pure, so it is tested
    without the GPU compiler."""
    if target.chip is None:  # this machine's own devices: their runtime checks memory
        return None
    need, available = memory.get("total", 0), target.chip.hbm_bytes
    return (need, available) if need > available else None


class OverHbm(Exception):
    def __init__(self, need: float, available: float):
        super().__init__(f"{need} bytes needed, {available} available")
        self.need = (need, available)


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_shortfall(e: Exception) -> tuple[float, float] | None:
    """``(needed, available)`` bytes from the TPU compiler's out-of-memory error (or ours)."""
    import re

    if isinstance(e, OverHbm):
        return e.need
    message = str(e)
    m = re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", message)
    if not m or "RESOURCE_EXHAUSTED" not in message:
        return None
    return float(m.group(1)) * _UNITS[m.group(2)], float(m.group(3)) * _UNITS[m.group(4)]


def format_report(report: dict, config_path: str) -> str:
    from hybridpar.tools import comm_report

    mesh = ", ".join(f"{k}={v}" for k, v in report["mesh"].items())
    lines = [
        f"compile: {config_path} for {report['target_description']}",
        f"mesh {mesh}; {len(report['programs'])} programs in {report['wall_s']:.1f}s"
        + (
            f"; across the {report['slices']} slices (DCN): "
            f"{', '.join(report['axes_across_slices'])}, the other axes within a slice (ICI)"
            if report["slices"] > 1
            else ""
        ),
        report.get("gradient_sync", ""),  # (reports saved before it have none)
        *([report["kernel_gradients"]] if report.get("kernel_gradients") else []),
        "",
        f"  {'program':<28} {'memory/chip':>12} {'temp':>10} {'GFLOP/chip':>11} "
        f"{'GB accessed':>11} {'collectives':>18} {'async':>5} {'exposed':>10} {'compile':>8} "
        f"{'max img/s/chip':>14}",
    ]
    for r in report["programs"]:
        m = r["memory"]
        name = f"{r['program']} b{r['batch']} {r['image_size']}px"
        flops = f"{r['flops'] / 1e9:.2f}" if r["flops"] else "-"
        flops += "+" if r.get("flop_loops") and r["flops"] else ""  # a count short of it
        accessed = f"{r['bytes_accessed'] / 1e9:.3f}" if r["bytes_accessed"] else "-"
        coll = f"{r['collective_ops']} / {byte_size(r['collective_bytes'])}"
        rate = r["max_images_per_s_per_chip"]
        lines.append(
            f"  {name:<28} {byte_size(m.get('total', 0)):>12} {byte_size(m.get('temp', 0)):>10}"
            f" {flops:>11} {accessed:>11} {coll:>18} {r['async_collective_ops']:>5} "
            f"{byte_size(r['bytes_exposed']):>10} {r['compile_s']:>7.1f}s "
            f"{rate if rate is not None else '-':>14}"
        )
    lines.append("what each collective overlaps (compute scheduled between its start and done):")
    for r in report["programs"]:
        lines.append(
            f"  {r['program']} b{r['batch']} {r['image_size']}px: "
            f"{byte_size(r['bytes_overlapped'])} overlapped ({r['ops_overlapped']} ops), "
            f"{byte_size(r['bytes_exposed'])} exposed ({r['ops_exposed']} ops)"
            + (f"; {comm_report.hidden_text(r['bytes_overlapped'], r['bytes_hidden_est'])}"
               if r.get("bytes_hidden_est") is not None else "")  # fmt: skip
        )
        alike, nbytes = Counter(e["text"] for e in r["overlap"]), Counter()
        for e in r["overlap"]:
            nbytes[e["text"]] += e["bytes"]
        for text, _ in nbytes.most_common(OVERLAP_LINES):
            lines.append(f"    {alike[text]} x {text}")
        if len(alike) > OVERLAP_LINES:
            lines.append(f"    ... {len(alike) - OVERLAP_LINES} more (--json lists every one)")
    if report["hbm_bytes_per_chip"]:
        lines.append(f"  (HBM per chip: {byte_size(report['hbm_bytes_per_chip'])})")
    big = max(report["programs"], key=lambda r: r["memory"].get("total", 0))
    if any(r.get("max_images_per_s_per_chip") for r in report["programs"]):
        # the table's last column, said only where it has a figure (none without chips')
        lines.append(
            "max img/s/chip: the images a step over its FLOPs at the chip's peak, a bound no "
            "step beats (memory traffic, collectives, launch and input not counted)"
        )
        if big.get("bytes_accessed_s") and big.get("flops_bound_step_s"):
            lines.append(
                f"  XLA's bytes accessed at HBM bandwidth would take "
                f"{big['bytes_accessed_s'] * 1e3:.3g} ms a step ({_name(big)}; its FLOPs "
                f"{big['flops_bound_step_s'] * 1e3:.3g} ms): no bound, that count is more than "
                "the HBM traffic (docs/scaling.md)"
            )
    loops = [r for r in report["programs"] if r.get("flop_loops") and r["flops"]]
    if loops:
        lines.append(
            "GFLOP/chip +: XLA counts a loop's body once, and "
            + ", ".join(f"{_name(r)} runs {r['flop_loops']}" for r in loops)
            + " loops of convolutions or dots (on an fsdp mesh, the TPU compiler's windowed "
            "einsums): the program computes more than its count, and its bound is looser"
        )
    if report["out"]:  # printed before the file is written: a failed write is an error after
        lines.append(
            f"writing the {len(report['programs'])} programs to {report['out']}"
            + (" (replacing the file there)" if report.get("replacing") else "")
        )
    # every per-program figure is the largest program's, the one largest= names
    rates = [r["max_images_per_s_per_chip"] for r in report["programs"]
             if r["program"] == "train"]  # fmt: skip
    lines.append(
        f"memory_per_chip_bytes={big['memory'].get('total')} "
        f"largest={big['program']}:b{big['batch']}:{big['image_size']}px "
        f"flops_per_chip={big['flops']} "
        f"max_images_per_s_per_chip={min(rates) if all(rates) else None} "
        f"collective_bytes={big['collective_bytes']} "
        f"exposed_bytes={big['bytes_exposed']} "
        # what the compute beside them can hide, by estimate (None without chip figures):
        # "not exposed" only says something was scheduled between a start and its done
        f"hidden_bytes_est={big.get('bytes_hidden_est')} target={report['target']} "
        f"programs={len(report['programs'])} wall_s={report['wall_s']}"
    )
    return "\n".join(lines)


def _name(r: dict) -> str:
    return f"{r['program']} b{r['batch']} {r['image_size']}px"


def main(argv=None) -> None:
    if argv is None:  # the command itself (a TPU target's compile needs it: see there)
        targets.unlimited_stack_for_tpu(sys.argv[1:])
    parser = cli.ArgumentParser(
        "python -m hybridpar.compile",
        (
            "Compile every program a run would compile (each stage's train step, the eval step) "
            "for a target such as tpu:v5e-16, without running anything; --out saves them for "
            "train --compiled."
        ),
    )
    parser.add_argument(
        "--target",
        help="cpu:N (N virtual CPU devices), tpu:CHIP-N[,slices=S], e.g. tpu:v5e-16, or "
        "gpu:GPU-N, e.g. gpu:h100-16 (default: this machine's devices)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write the compiled programs here, for python -m hybridpar.train --compiled FILE",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out FILE")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args, config = cli.parse(parser, argv)
    # before anything compiles (seconds to minutes): a flag that would do nothing is refused
    if args.out == "":
        cli.fail("--out '' names no file: pass the file to write the compiled programs to, "
                 "e.g. --out programs.bin, or drop --out")  # fmt: skip
    if args.overwrite and args.out is None:
        cli.fail("--overwrite needs --out, the file it lets replace; drop --overwrite")

    def run():
        if args.target:
            from hybridpar.tools import comm_report

            # parsed, and a cpu:N over the virtual-device bound refused before anything starts
            target = comm_report.target_of(args.target, None)
            targets.prepare(target, config.comm)
        else:  # this machine's own devices: no chip figures, so no capacity or bound
            import jax

            from hybridpar.parallel import comm

            comm.apply(config.comm)  # the run's XLA flags, before the backend starts
            target = targets.Target(jax.default_backend(), jax.device_count())

        stdout = sys.stdout  # the report's, whatever prints elsewhere meanwhile

        def show(report):  # before --out is written: a failed write keeps the report
            print(json.dumps(report) if args.json else format_report(report, args.config_path),
                  file=stdout, flush=True)  # fmt: skip

        def say(line):  # progress: on stderr under --json, so stdout is the one object
            print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

        # the run's set-up prints its warnings on stdout, as the trainer's log does: under
        # --json they go to stderr, so stdout is the one object
        quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
        with quiet:
            compile_programs(config, target, args.out, show=show, say=say,
                             overwrite=args.overwrite)  # fmt: skip

    cli.main(run)


if __name__ == "__main__":
    main()
