"""The compiler workarounds ``comm.apply`` adds for the installed jaxlib, and how a user's
own flag wins over them; the comm settings a config may not leave unread, and the words
of the gradient sync's refusals."""

import os
from importlib import metadata
from pathlib import Path

import pytest

from hybridpar import ConfigError, make_mesh
from hybridpar.config.schema import base_config, sizes_training_ignores, unused_settings
from hybridpar.parallel import comm
from hybridpar.program.sync import make_sync

TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"


def test_triton_gemm_workaround_follows_the_jaxlib_version():
    # Seen on 0.11.2: from 0.11 on a GPU run gets it; 0.10 and other platforms do not.
    assert comm.workaround_flags("gpu", (0, 11)) == [TRITON_OFF]
    assert comm.workaround_flags("cuda", (0, 12)) == [TRITON_OFF]
    assert comm.workaround_flags("gpu", (0, 10)) == []
    assert comm.workaround_flags("tpu", (0, 11)) == []
    assert comm.workaround_flags("cpu", (0, 11)) == []


def _jaxlib(monkeypatch, version: str):
    """The installed jaxlib's version, as its package metadata gives it, replaced."""
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda n: version if n == "jaxlib" else real(n))


def test_the_installed_jaxlib_version_is_read_from_its_metadata(monkeypatch):
    # this suite pins jax 0.10: no workaround, as for the version given
    assert metadata.version("jaxlib").startswith("0.10.")
    assert comm.workaround_flags("gpu") == comm.workaround_flags("gpu", (0, 10)) == []
    _jaxlib(monkeypatch, "0.11.2")  # the default is read again on each call
    assert comm.workaround_flags("gpu") == [TRITON_OFF]
    _jaxlib(monkeypatch, "0.12.0rc1")
    assert comm.workaround_flags("gpu") == [TRITON_OFF]


def test_apply_adds_the_workaround_unless_the_user_set_that_flag(monkeypatch):
    c = base_config().comm
    _jaxlib(monkeypatch, "0.11.2")
    monkeypatch.setenv("XLA_FLAGS", "--foo=1")
    assert TRITON_OFF in comm.apply(c, "gpu")
    assert TRITON_OFF in os.environ["XLA_FLAGS"].split()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert TRITON_OFF not in comm.apply(c, "gpu")  # the user's own choice wins
    assert "--xla_gpu_enable_triton_gemm=true" in os.environ["XLA_FLAGS"].split()
    assert TRITON_OFF not in os.environ["XLA_FLAGS"].split()
    _jaxlib(monkeypatch, "0.10.0")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert TRITON_OFF not in comm.apply(c, "gpu")


def _libtpu(monkeypatch, version: str | None):
    """The installed libtpu's version, as its package metadata gives it (None: not there)."""
    real = metadata.version

    def version_of(name):
        if name != "libtpu":
            return real(name)
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(metadata, "version", version_of)


def test_tpu_all_reduces_are_made_asynchronous_from_the_libtpu_that_has_the_flags(monkeypatch):
    # Without them libtpu compiles every all-reduce synchronous (tests/test_compile_targets.py
    # compiles it); comm.latency_hiding turns them on or off with the scheduler.
    on, off = base_config().comm, base_config().comm
    on.mode = off.mode = "overlap"
    off.latency_hiding = False
    names = comm.TPU_ASYNC_ALL_REDUCE[1]
    _libtpu(monkeypatch, "0.0.42.1")
    assert [f for f in comm.xla_flags(on, "tpu") if f.split("=")[0] in names] == [
        f"{n}=true" for n in names]  # fmt: skip
    assert [f for f in comm.xla_flags(off, "tpu") if f.split("=")[0] in names] == [
        f"{n}=false" for n in names]  # fmt: skip
    for older in ("0.0.41", None):  # a libtpu that may not know them aborts on them
        _libtpu(monkeypatch, older)
        assert comm.xla_flags(on, "tpu") == ["--xla_tpu_enable_latency_hiding_scheduler=true"]
    _libtpu(monkeypatch, "0.0.42.1")
    assert not any(f.split("=")[0] in names for f in comm.xla_flags(on, "gpu"))
    for mode in ("bucketed", "xla"):  # xla's all-reduces end the step: nothing to overlap
        c = base_config().comm
        c.mode = mode
        assert any(f.split("=")[0] in names for f in comm.xla_flags(c, "tpu")) == (
            mode == "bucketed")  # fmt: skip
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_enable_async_all_reduce=false")
    added = comm.apply(on, "tpu")  # the user's own setting wins, the other flag is added
    assert "--xla_enable_async_all_reduce=true" not in added and f"{names[1]}=true" in added
    assert os.environ["LIBTPU_INIT_ARGS"].split()[0] == "--xla_enable_async_all_reduce=false"


def test_sparsecore_offload_on_the_chips_it_was_measured_on(monkeypatch):
    """comm.sparsecore_offload=auto runs the all-reduces on the SparseCores of the chips
    listed (v5p), read from TPU_ACCELERATOR_TYPE as a TPU VM sets it; on/off force it; a
    libtpu older than the flags, or another platform, gets none."""
    _, chips, offload = comm.TPU_SPARSECORE_ALL_REDUCE
    assert chips == ("v5p",)

    def offloaded(chip, mode="auto", platform="tpu"):
        c = base_config().comm
        c.sparsecore_offload = mode
        return [f for f in comm.xla_flags(c, platform, chip) if f in offload]

    _libtpu(monkeypatch, "0.0.42")
    assert offloaded("v5p") == list(offload)
    assert offloaded("v5e") == offloaded(None) == offloaded("v5p", "off") == []
    assert offloaded("v5e", "on") == list(offload)
    assert offloaded("v5p", platform="gpu") == []
    _libtpu(monkeypatch, "0.0.41")
    assert offloaded("v5p") == []
    for kind, chip in (("v5p-128", "v5p"), ("v5litepod-16", "v5e"), ("v6e-8", "v6e"),
                       ("", None)):  # fmt: skip
        monkeypatch.setenv("TPU_ACCELERATOR_TYPE", kind)
        assert comm.tpu_chip() == chip
    _libtpu(monkeypatch, "0.0.42")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-128")
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
    assert set(offload) <= set(comm.apply(base_config().comm, "tpu"))


def test_settings_nothing_reads_are_named_with_the_fix():
    """comm.mode=xla never buckets, and only float16 scales its loss: a comm.bucket_mb or a
    loss_scale_* set there did nothing without a word. auto may resolve to the overlap mode
    (on GPUs), so it keeps its buckets; the defaults inherited say nothing. Planted bug that
    fails it: no check (nothing named)."""
    c = base_config()
    assert unused_settings(c) == []
    c.comm.mode, c.comm.bucket_mb = "xla", 8.0
    c.precision.loss_scale_initial = 1024.0
    said = unused_settings(c)
    assert len(said) == 2, said
    assert said[0].startswith("comm.bucket_mb=8.0 does nothing: comm.mode='xla' never buckets")
    assert said[0].endswith("drop --config.comm.bucket_mb, or use --config.comm.mode=bucketed "
                            "or overlap")  # fmt: skip
    assert said[1].startswith("precision.loss_scale_initial=1024.0 does nothing: only float16")
    for mode in ("auto", "bucketed", "overlap"):
        c.comm.mode = mode
        assert not any(x.startswith("comm.bucket_mb") for x in unused_settings(c))
    c.precision.compute = "float16"
    assert unused_settings(c) == []
    # with stages, each stage's batch is its own: a global_batch was dropped unsaid
    c.stages, c.global_batch = "2:32-64", 128
    (said,) = unused_settings(c)
    assert said.startswith("global_batch=128 does nothing: config.stages ('2:32-64') sets")
    c.stages, c.global_batch = "", base_config().global_batch
    # pointed at data the run does not read (digits trained on while data.source named a
    # tar); a recipe's smoke test on synthetic data does that on purpose: said, not refused
    c.data.name, c.data.source, c.data.tfds_name = "digits", "/x/train.tar", "mnist"
    said = unused_settings(c)
    assert said == [
        "data.source='/x/train.tar' does nothing: it is read only with data.name='images', "
        "and this run trains on data.name='digits'; set --config.data.name=images to train "
        "on it, or drop data.source",
        "data.tfds_name='mnist' does nothing: it is read only with data.name='tfds', and "
        "this run trains on data.name='digits'; set --config.data.name=tfds to train on it, "
        "or drop data.tfds_name",
    ], said


def test_an_eval_size_that_training_on_a_real_set_ignores_is_said():
    """``--config.data.eval_examples=1000`` on images evaluated every image of the split,
    without a word: those sizes are nominal there (a recipe sets ImageNet's for the tools
    that compile without data), so said only where the command line set them, and not on
    synthetic data, which they size. Planted bug that fails it: the train tool without the
    warning (the CLI test below)."""
    c = base_config()
    keys = ["data.eval_examples", "optim.lr", "data.train_examples", "data.eval_examples"]
    assert sizes_training_ignores(c, keys) == []  # synthetic: they size it
    c.data.name, c.data.eval_split, c.data.eval_examples = "images", "val", 1000
    said = sizes_training_ignores(c, keys)
    assert said == [
        "data.eval_examples=1000 does nothing in training on data.name='images': the "
        "evaluation reads every example of the eval split 'val'; it sizes only synthetic data "
        "and the plans of the tools that compile without data (compile, plan, simulate); drop "
        "--config.data.eval_examples",
        "data.train_examples=4096 does nothing in training on data.name='images': an epoch is "
        "every example of the train split 'train'; it sizes only synthetic data and the plans "
        "of the tools that compile without data (compile, plan, simulate); drop "
        "--config.data.train_examples",
    ], said
    assert sizes_training_ignores(c, ["optim.lr"]) == []  # a recipe's value is not said
    c.data.name = "digits"
    assert "eval part of digits" in sizes_training_ignores(c, keys)[0]


def test_the_train_cli_says_an_ignored_eval_size_before_set_up(tmp_path, capfd):
    """The warning reaches the user from the train command (here before set-up's error on
    a stage of no step, so nothing compiles)."""
    from hybridpar.tools import train

    digits = str(Path(__file__).resolve().parents[1] / "experiments" / "digits.py")
    capfd.readouterr()
    with pytest.raises(SystemExit):
        train.main(["--config", digits, "--workdir", str(tmp_path / "w"),
                    "--config.data.eval_examples=100",
                    "--config.stages=1:16-32~0.8,1.001:24-16,3:32-8", "--config.num_epochs=3"])
    out = capfd.readouterr().out
    assert "warning: data.eval_examples=100 does nothing in training on data.name='digits'" in out


@pytest.mark.parametrize(
    "mesh, overrides, says",
    [
        ("data:8", {"model.head": "sharded"}, "model.head='sharded' splits the classes over "
         "the model axis, which has one device on mesh data:8,fsdp:1,model:1: it does the "
         "dense head's work"),
        ("data:8", {"partitioning.preset": "hybrid"}, "partitioning.preset='hybrid' splits "
         "parameters over the model axis, which has one device"),
        ("data:4,model:2", {"partitioning.preset": "fsdp"}, "partitioning.preset='fsdp' "
         "splits parameters over the fsdp axis, which has one device"),
        ("data:4,fsdp:2", {"partitioning.preset": "tensor"}, "partitioning.preset='tensor' "
         "splits parameters over the model axis, which has one device"),
        ("data:1", {"comm.mode": "overlap"}, "comm.mode='overlap' reduces gradients across "
         "data-parallel devices, and mesh data:1,fsdp:1,model:1 has one"),
        ("data:8", {"partitioning.fsdp_min_size": 1024}, "partitioning.fsdp_min_size=1024 "
         "splits large arrays over the fsdp axis, which has one device"),
        ("data:4,fsdp:2", {"partitioning.fsdp_min_size": 1024}, None),
        ("data:4,model:2", {"model.head": "sharded", "partitioning.preset": "hybrid"}, None),
    ],
)  # fmt: skip
def test_set_up_warns_of_what_the_mesh_leaves_nothing_to_do(mesh, overrides, says, capsys):
    """A sharded head, a preset, an FSDP pass or a reduction mode whose axis has one device:
    the run trains as the default would, which was not said. Planted bug that fails it: no
    warning."""
    import jax
    from helpers import tiny_digits

    from hybridpar.runtime.run import setup

    config = tiny_digits(mesh, **overrides)
    n = 1 if mesh == "data:1" else 8
    setup(config, with_data=False, devices=jax.devices()[:n])
    warned = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
    assert len(warned) == (0 if says is None else 1), warned
    assert says is None or says in warned[0]


def test_set_up_warns_of_a_setting_nothing_reads(tmp_path, capsys):
    """The run's set-up prints each of ``unused_settings`` as a warning line (not an error:
    plan's and tune's variants of a config leave a user's setting unread in some of them).
    Planted bug that fails it: set-up not calling it."""
    from helpers import tiny_digits

    from hybridpar.runtime.run import setup

    setup(tiny_digits(**{"comm.mode": "xla", "comm.bucket_mb": 8.0}), str(tmp_path),
          with_data=False)  # fmt: skip
    out = capsys.readouterr().out
    assert "warning: comm.bucket_mb=8.0 does nothing: comm.mode='xla' never buckets" in out, out


def test_the_xla_sync_refusal_names_the_mode_set_and_what_auto_resolved_to():
    """comm.reduce_dtype=bfloat16 on a mesh with a model axis: under comm.mode=auto (the
    default) the error said "under comm.mode=xla", a mode the user never set. Planted bug
    that fails it: the old fixed words."""
    c = base_config()
    c.comm.reduce_dtype = "bfloat16"
    mesh = make_mesh("data:4,model:2")
    with pytest.raises(ConfigError, match=r"^comm.reduce_dtype='bfloat16' under comm.mode=auto "
                       r"\(resolved to xla: a model axis, .*\) needs a mesh over data only "
                       r"\(this one has model=2\)"):  # fmt: skip
        make_sync(c, mesh, None)
    c.comm.mode = "xla"
    with pytest.raises(ConfigError, match=r"^comm.reduce_dtype='bfloat16' under comm.mode=xla "
                       r"needs a mesh over data only"):  # fmt: skip
        make_sync(c, mesh, None)
