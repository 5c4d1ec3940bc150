"""``python -m hybridpar.prune --workdir W --out DIR --fraction F [--criterion l1|bn]``.

Structured channel pruning of a trained ResNet (models/resnet.py) or airbench net
(models/airbench.py, whose convs each make a group of their own): whole output channels of
convolutions are removed, with their BatchNorm entries and the matching input channels of
every layer that reads them, so what is left is a ResNet of the same family with narrower
widths (``model.stem_width``, ``model.stage_widths``, ``model.block_widths``).

Channels that meet in a residual add are one group with one keep-mask: the stem's output and
every block output of stage 1 (identity shortcuts), then per stage the projection's output
and every block output of that stage; each block's inner convs are groups of their own. A
group's channels are ranked by the sum over its producing layers of ``|gamma|`` of the
BatchNorm after each (``bn``, network slimming's measure) or of the L1 norm of the folded
filter (``l1``: ``|gamma| / sqrt(var + eps) * sum |W[..., c]|``, the output's scale).

``DIR`` is then a run of the smaller model at step 0: its ``config.json`` (the source run's
config with the narrower widths), a checkpoint (the surviving parameters and statistics,
a fresh optimizer state) and ``pruned.json`` (the source run and step, the fraction, the
criterion), so ``quantize``, ``evaluate`` and ``train --config.init_from=DIR`` read it as
they read any run; the command prints that train command whole (``train_command``: the
pruned run's ``config.json`` as its ``--config``). ``DIR`` inside ``W`` is an ``error:``
(``W`` is read only); a source run whose training has not finished (still training, stopped
early) is pruned with a ``warning:`` line naming its step and (where its summary or records
say) the run's steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from hybridpar.config import cli
from hybridpar.config.errors import ConfigError
from hybridpar.runtime import signals, trained
from hybridpar.tools import quantize

CRITERIA = ("bn", "l1")
RECORD = trained.PRUNED_RECORD  # where the pruned run came from, and how


@dataclasses.dataclass
class Group:
    """Channels tied together: ``producers`` (conv path, its BatchNorm's path) write them,
    ``consumers`` (conv paths, and ``head``) read them on their input axis."""

    name: str
    producers: list
    consumers: list


def groups(model, params) -> list[Group]:
    """The channel groups of a ResNet (or the airbench net) and its (unboxed) params, in
    the order of the forward pass."""
    from hybridpar.program import int8

    arch = int8.architecture(model, params)  # the same model check and block walk
    if isinstance(arch, int8.AirbenchArch):  # no residuals: every conv's output on its own
        out = []
        for i in range(1, arch.blocks + 1):
            b, after = f"block{i}", f"block{i + 1}_conv1" if i < arch.blocks else "head"
            out.append(Group(f"{b}_conv1", [(f"{b}_conv1", f"{b}_bn1")], [f"{b}_conv2"]))
            out.append(Group(f"{b}_conv2", [(f"{b}_conv2", f"{b}_bn2")], [after]))
        return out
    stream = Group("stem", [("stem_conv", "stem_bn")], [])
    out = [stream]
    for b in arch.blocks:
        n = b.name
        convs = ["conv1", "conv2", "conv3"] if b.bottleneck else ["conv1", "conv2"]
        stream.consumers.append(f"{n}/conv1")
        if b.projects:
            stream.consumers.append(f"{n}/proj_conv")
            stream = Group(n.split("_")[0], [(f"{n}/proj_conv", f"{n}/proj_bn")], [])
            out.append(stream)
        last = convs[-1]
        stream.producers.append((f"{n}/{last}", f"{n}/{int8.BN_OF[last]}"))
        for i, c in enumerate(convs[:-1]):
            out.append(Group(f"{n}/{c}", [(f"{n}/{c}", f"{n}/{int8.BN_OF[c]}")],
                             [f"{n}/{convs[i + 1]}"]))  # fmt: skip
    stream.consumers.append("head")
    return out


def _get(tree, path: str):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def importance(group: Group, params, stats, criterion: str, epsilon: float) -> np.ndarray:
    """One score per channel of ``group`` (higher: kept first)."""
    if criterion not in CRITERIA:
        raise ConfigError(f"--criterion={criterion!r} is not one of {', '.join(CRITERIA)}")
    score = 0.0
    for conv, bn in group.producers:
        gamma = np.abs(np.asarray(_get(params, bn)["scale"], np.float64))
        if criterion == "bn":
            score = score + gamma
        else:
            var = np.asarray(_get(stats, bn)["var"], np.float64)
            w = np.abs(np.asarray(_get(params, conv)["kernel"], np.float64))
            score = score + gamma / np.sqrt(var + epsilon) * w.sum(axis=(0, 1, 2))
    return score


def keep_masks(gs: list[Group], params, stats, counts: dict, criterion="l1", epsilon=1e-5):
    """``{group name: sorted indices kept}``: the ``counts[name]`` best channels of each
    group (a group not in ``counts`` keeps all)."""
    keep = {}
    for g in gs:
        score = importance(g, params, stats, criterion, epsilon)
        n = int(counts.get(g.name, score.size))
        if not 1 <= n <= score.size:
            raise ConfigError(f"group {g.name}: cannot keep {n} of {score.size} channels")
        keep[g.name] = np.sort(np.argsort(-score, kind="stable")[:n])
    return keep


def param_count(gs: list[Group], params, counts: dict) -> int:
    """The parameters of ``params``' model with ``counts[name]`` channels in each group (a
    group not in ``counts`` keeps its width): the producers' kernels and BatchNorm entries
    and the readers' kernels change, everything else stays."""
    import jax

    width = {**group_widths(gs, params), **counts}
    out_of = {conv: g.name for g in gs for conv, _ in g.producers}
    in_of = {path: g.name for g in gs for path in g.consumers}
    bns = {bn: g.name for g in gs for _, bn in g.producers}
    total, touched = 0, set()
    for path in [*out_of, *in_of, *bns]:
        if path in touched:
            continue
        touched.add(path)
        for name, leaf in _get(params, path).items():
            shape = list(np.shape(leaf))
            total -= int(np.prod(shape))
            if path in bns:
                shape[-1] = width[bns[path]]
            elif name == "kernel":
                axis = 0 if path == "head" else 2
                if path in in_of:
                    shape[axis] = width[in_of[path]]
                if path in out_of:
                    shape[-1] = width[out_of[path]]
            elif path in out_of:  # a producer's bias
                shape[-1] = width[out_of[path]]
            total += int(np.prod(shape))
    return total + int(sum(np.size(x) for x in jax.tree.leaves(params)))


def int8_bytes(model, gs: list[Group], params, stats, counts: dict) -> int:
    """The bytes of ``quantize``'s int8 weights (``weight_bytes_int8``: int8 kernels, their
    float32 steps, the folded biases, each layer's activation step and zero point) of
    ``params``' model with ``counts[name]`` channels in each group. Exact: the same folding
    and quantization on the pruned shapes (which channels are kept changes no size). Not
    ``param_count`` times a ratio: the per-channel steps and biases weigh more per
    parameter the narrower the model."""
    from hybridpar.program import int8

    return int8.tree_bytes(quantized(model, gs, params, stats, counts)[1])


def quantized(model, gs: list[Group], params, stats, counts: dict):
    """``(arch, q)``: ``params``' model with ``counts[name]`` channels in each group (the
    first ones), folded and quantized as ``quantize`` does, every activation step 1/255 of
    ``[0, 1]``: its sizes (``int8_bytes``, ``edge.predict_bytes``), not its values."""
    from hybridpar.program import int8

    widths = group_widths(gs, params)
    keep = {g.name: np.arange(int(counts.get(g.name, widths[g.name]))) for g in gs}
    p, s = apply(gs, params, stats, keep)
    arch = int8.architecture(model, p)
    layers = int8.fold_batchnorm(arch, p, s, model.bn_epsilon)
    ranges = {k: {"min": 0.0, "max_abs": 1.0} for k, v in layers.items() if "kernel" in v}
    return arch, int8.quantize(layers, ranges)


def apply(gs: list[Group], params, stats, keep: dict):
    """``(params, stats)`` with only the kept channels (numpy copies; inputs unchanged)."""
    import jax

    params = jax.tree.map(np.asarray, params)
    stats = jax.tree.map(np.asarray, stats)
    for g in gs:
        idx = keep[g.name]
        for conv, bn in g.producers:
            p = _get(params, conv)
            p["kernel"] = p["kernel"][..., idx]
            for tree in (_get(params, bn), _get(stats, bn)):
                for k in tree:
                    tree[k] = tree[k][idx]
        for path in g.consumers:
            p = _get(params, path)
            p["kernel"] = p["kernel"][idx] if path == "head" else p["kernel"][:, :, idx, :]
    return params, stats


def widths_of(model, params) -> dict:
    """The config's width keys that give ``params``' shapes: ``{"stem_width": ...,
    "stage_widths": (...), "block_widths": (...)}``."""
    from hybridpar.program import int8

    arch = int8.architecture(model, params)
    if isinstance(arch, int8.AirbenchArch):
        n = range(1, arch.blocks + 1)
        return {
            "stage_widths": tuple(int(params[f"block{i}_conv2"]["kernel"].shape[-1]) for i in n),
            "block_widths": tuple(int(params[f"block{i}_conv1"]["kernel"].shape[-1]) for i in n),
        }
    last = "conv3" if arch.blocks[0].bottleneck else "conv2"
    stages = {}
    for b in arch.blocks:
        stages[b.name.split("_")[0]] = int(params[b.name][last]["kernel"].shape[-1])
    return {
        "stem_width": int(params["stem_conv"]["kernel"].shape[-1]),
        "stage_widths": tuple(stages.values()),
        "block_widths": tuple(
            int(params[b.name]["conv1"]["kernel"].shape[-1]) for b in arch.blocks
        ),  # fmt: skip
    }


def group_widths(gs: list[Group], params) -> dict:
    return {g.name: int(_get(params, g.producers[0][0])["kernel"].shape[-1]) for g in gs}


def counts_for(gs: list[Group], widths: dict, keep_fraction: float) -> dict:
    """Channels to keep per group: ``keep_fraction`` of ``widths`` (a group's width in the
    model the fraction refers to), at least one; a bottleneck block's two inner convs keep
    the same number (block_widths has one width per block)."""
    counts = {g.name: max(1, int(round(widths[g.name] * keep_fraction))) for g in gs}
    for name in list(counts):
        if name.endswith("/conv2") and name.replace("/conv2", "/conv1") in counts:
            counts[name] = counts[name.replace("/conv2", "/conv1")]
    return counts


# ---- Reading and writing runs ------------------------------------------------------------


def write_run(config, params, stats, out: str, mesh, record: dict | None = None) -> None:
    """``out``: ``config.json`` and a step-0 checkpoint of ``params`` / ``stats`` (host
    arrays) with a fresh optimizer state, and ``record`` as ``RECORD``, written beside and
    moved into place."""
    import jax

    from hybridpar.program import program
    from hybridpar.program.state import init_sharded
    from hybridpar.runtime import checkpoint, run_config
    from hybridpar.runtime.run import LoopState

    prog = program.build_program(config, mesh)
    state = init_sharded(prog.init, prog.shardings, jax.random.key(config.seed))
    state = state.replace(
        params=jax.device_put(params, prog.shardings.params),
        batch_stats=jax.device_put(stats, prog.shardings.batch_stats),
    )
    tmp = temp_of(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        run_config.record_config(tmp, config)
        if record is not None:
            with open(os.path.join(tmp, RECORD), "w") as f:
                json.dump(record, f, indent=1)
        saver = checkpoint.Checkpoints(os.path.join(tmp, "checkpoints"), async_save=False)
        try:
            saver.save(0, state, LoopState(seed=config.seed).to_dict(),
                       run_config.config_dict(config))  # fmt: skip
            saver.finished(wait=True)
        finally:
            saver.close()
        with signals.whole():  # the command's SIGINT / SIGTERM says what the rename left
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temp_of(out: str) -> str:
    """Where ``write_run`` writes the run before it renames it to ``out``."""
    return os.path.abspath(f"{out}.tmp-{os.getpid()}")  # orbax takes absolute paths only


def pruned_config(config, widths: dict):
    """The source's config with the narrower widths; its checkpoints in the pruned run's own
    folder (``write_run``), not where the source's ``checkpoint.dir`` points: a tool reading
    the pruned run would read the source's there."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.model.update(widths)
        c.init_from = ""
        c.checkpoint.dir = ""
    return c


def prune_run(workdir: str, out: str, keep_fraction: float, *, criterion="l1",
              reference=None, mesh=None) -> dict:  # fmt: skip
    """Prunes the run in ``workdir`` to ``keep_fraction`` of each group's width in
    ``reference`` (``{group: width}``, default: this model's) and writes the smaller run to
    ``out``. Returns ``{"widths", "params", "kept"}``."""
    import jax

    from hybridpar.parallel.mesh import make_mesh
    state = trained.unfinished(workdir)  # before reading: a trainer may write on
    mesh = mesh or make_mesh("data:-1")
    src = trained.TrainedRun(workdir, mesh)
    params, stats = src.host_variables()
    gs = groups(src.model, params)
    counts = counts_for(gs, reference or group_widths(gs, params), keep_fraction)
    keep = keep_masks(gs, params, stats, counts, criterion, src.model.bn_epsilon)
    params, stats = apply(gs, params, stats, keep)
    widths = widths_of(src.model, params)
    record = {"source": os.path.abspath(workdir), "source_step": int(src.step),
              "keep_fraction": keep_fraction, "criterion": criterion, "widths": widths,
              "source_unfinished": state}  # fmt: skip
    config = pruned_config(src.config, widths)
    write_run(config, params, stats, out, mesh, record)
    n = int(sum(np.size(x) for x in jax.tree.leaves(params)))
    return {"widths": widths, "params": n, "kept": {k: len(v) for k, v in keep.items()},
            "step": int(src.step), "unfinished": state, "config": config}  # fmt: skip


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or under it (links resolved)."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def train_command(out: str) -> str:
    """The command that trains the pruned run ``out`` on: its ``config.json`` as the config
    (every key as the pruned run has it; a command line of the keys that differ from the
    defaults, on the run's own config file, lost those the file sets otherwise), a new
    workdir, and its weights (``init_from``)."""
    import shlex

    config = shlex.quote(os.path.join(os.path.abspath(out), "config.json"))
    return (f"python -m hybridpar.train --config {config} --workdir NEW_DIR "
            f"--config.init_from={shlex.quote(os.path.abspath(out))}")  # fmt: skip


def planned_steps(workdir: str, config) -> int | None:
    """The steps the run in ``workdir`` plans, from its records where no summary says them
    (a run still training): its stages on the training examples of its last start's data
    record, at that start's data-parallel size, if the steps its stage records hold agree
    (a set read over several processes may have fewer steps an epoch); else None."""
    from hybridpar.config.curriculum import plan_stages, stages_from_config
    from hybridpar.runtime import run_records

    recs = run_records.read_records(os.path.join(workdir, "metrics.jsonl"))[0]
    starts = [i for i, r in enumerate(recs) if r.event == "data"]
    stages = [r for r in recs[starts[-1] :] if r.event == "stage"] if starts else []
    n = recs[starts[-1]].train_examples if starts else None
    if not n or not stages:
        return None
    try:
        plan = plan_stages(stages_from_config(config, stages[-1].data_parallel or 1),
                           lambda batch: n // batch)  # fmt: skip
    except ConfigError:
        return None
    planned = {ps.index: ps.num_steps for ps in plan.stages}
    if any(planned.get(r.stage) != r.steps for r in stages):
        return None
    return plan.total_steps


def main(argv=None) -> None:
    parser = cli.ArgumentParser(
        "python -m hybridpar.prune",
        (
            "Remove --fraction of the channels of a trained run's convolutions (whole channels, "
            "the least important by --criterion, in every group): the smaller model as a new "
            "run at step 0, for train --config.init_from."
        ),
        takes_config=False,
        # by hand: three are required, but a missing one is our error line, not argparse's
        usage="%(prog)s [-h] --workdir WORKDIR --out OUT --fraction FRACTION\n"
        "       [--criterion {bn,l1}]",
    )
    parser.add_argument("--workdir", help="the trained run's workdir (read only)")
    parser.add_argument("--out", help="where the pruned run goes (a new directory)")
    parser.add_argument("--fraction", type=cli.finite_float,
                        help="fraction of each group's channels to remove, in [0, 1)")  # fmt: skip
    parser.add_argument("--criterion", choices=CRITERIA, default="l1",
                        help="l1: folded filter L1 (default); bn: BatchNorm |scale|")  # fmt: skip
    args, _ = cli.parse(parser, argv, from_run=True)
    if args.config_path or args.config_overrides:  # else silently not the config pruned
        cli.fail(
            "prune reads the run's own config from --workdir: drop --config and "
            "--config.KEY (pass them to the train command that trains the pruned run)"
        )
    if not args.workdir or not args.out or args.fraction is None:
        cli.fail("pass --workdir DIR (a trained run), --out NEW_DIR and --fraction F")
    quantize.check_workdir(args.workdir)
    if not 0 <= args.fraction < 1:
        cli.fail(f"--fraction={args.fraction} must be in [0, 1), e.g. 0.5")
    if inside(args.out, args.workdir):  # the source run is read only
        cli.fail(f"--out {args.out} is inside --workdir {args.workdir} (the run pruned, read "
                 "only): pass a directory outside it")  # fmt: skip
    if os.path.exists(args.out):
        cli.fail(f"--out {args.out} exists: pass a new directory, or move it away first")

    def go():
        trained.load_config(args.workdir)  # a run's config.json, or the error that says so
        r = prune_run(args.workdir, args.out, 1 - args.fraction, criterion=args.criterion)
        state = r["unfinished"]  # (also in the pruned run's RECORD)
        if state is not None:
            # the run's steps where its summary says, else its records' (a whole set-up,
            # data opened, to learn them otherwise)
            total = state.get("total_steps") or planned_steps(args.workdir, r["config"])
            trained.warn_unfinished(args.workdir, state, r["step"], total, "pruned")
        print(f"wrote {args.out}: {r['params']} parameters; train it with its config (the "
              "run's, with the narrower widths; add --config.KEY=VALUE to change one):\n  "
              f"{train_command(args.out)}")  # fmt: skip

    def stopped() -> str:  # prune_run writes beside --out and renames it in whole, last
        if os.path.exists(args.out):
            return f"{args.out} was written whole before the stop"
        return "nothing written"

    # SIGINT / SIGTERM: stop at once, the half-written run removed (a KeyboardInterrupt
    # inside JAX or a gc callback was dropped, and the run written anyway)
    with signals.StopWriting(temp_of(args.out), stopped):
        cli.main(go, stopped)


if __name__ == "__main__":
    main()
