"""Tests for hybridpar.parallel.mesh and hybridpar.parallel.partitioning (on 8 virtual CPU devices).

Everything works on shapes (ShapeDtypeStruct / jax.eval_shape) where it can, so nothing
large is allocated and nothing is compiled.
"""

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import build, tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridpar import (
    AXES,
    FSDP,
    ConfigError,
    Rules,
    infer_shardings,
    infer_spec,
    make_mesh,
    parse_mesh_spec,
    preset_rules,
    shard_batch,
)
from hybridpar.models import create_model
from hybridpar.parallel.partitioning import unmatched_rules

F32 = jnp.float32


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, F32)


@pytest.fixture(scope="module")
def mesh_dm():
    return make_mesh("data:4,model:2")


@pytest.fixture(scope="module")
def mesh_fsdp():
    return make_mesh("fsdp:8")


@pytest.fixture(scope="module")
def mesh_dfm():
    return make_mesh("data:2,fsdp:2,model:2")


# ----------------------------------------------------------------------------- mesh spec


def test_parse_mesh_spec_fills_missing_axes_in_order():
    sizes = parse_mesh_spec("data:4,model:2", 8)
    assert sizes == {"data": 4, "fsdp": 1, "model": 2}
    assert tuple(sizes) == ("data", "fsdp", "model")


def test_parse_mesh_spec_minus_one_fills_the_rest():
    assert parse_mesh_spec("data:-1,model:2", 8) == {"data": 4, "fsdp": 1, "model": 2}
    assert parse_mesh_spec("model:2,fsdp:-1", 8) == {"data": 1, "fsdp": 4, "model": 2}
    assert parse_mesh_spec("data:-1", 8) == {"data": 8, "fsdp": 1, "model": 1}


def test_parse_mesh_spec_wrong_product_names_device_count_and_flag():
    with pytest.raises(ConfigError) as e:
        parse_mesh_spec("data:4,model:4", 8)
    msg = str(e.value)
    assert "8" in msg and "16" in msg
    assert "xla_force_host_platform_device_count" in msg
    # the other fix, let one axis fill the devices: as a spec, then as the CLI's flag
    assert "e.g. 'data:-1', on the command line --config.mesh=data:-1" in msg
    # virtual devices are the CPU's remedy only: not suggested for a TPU's or GPU's count
    with pytest.raises(ConfigError) as e:
        parse_mesh_spec("data:4,model:4", 8, platform="tpu")
    assert "16 devices" in str(e.value) and "xla_force_host" not in str(e.value)


def test_parse_mesh_spec_unknown_axis():
    with pytest.raises(ConfigError) as e:
        parse_mesh_spec("dta:8", 8)
    msg = str(e.value)
    assert "dta" in msg
    # names the valid axes and shows the right form
    for axis in AXES:
        assert axis in msg
    assert "data:4,model:2" in msg


def test_parse_mesh_spec_missing_colon():
    with pytest.raises(ConfigError, match="AXIS:SIZE"):
        parse_mesh_spec("data8", 8)


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("data:abc", "not an integer"),
        ("data:0,model:8", ">= 1 or -1"),
        ("data:-2,model:4", ">= 1 or -1"),
    ],
)
def test_parse_mesh_spec_bad_size(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_mesh_spec(spec, 8)


def test_parse_mesh_spec_two_fills():
    with pytest.raises(ConfigError, match="only one axis may be -1"):
        parse_mesh_spec("data:-1,model:-1", 8)


@pytest.mark.parametrize("spec", ["data:4,data:2", "data:-1,data:2", "data:2,data:-1"])
def test_parse_mesh_spec_duplicate_axis(spec):
    with pytest.raises(ConfigError, match="twice"):
        parse_mesh_spec(spec, 8)


def test_parse_mesh_spec_fill_that_cannot_divide():
    with pytest.raises(ConfigError, match="-1 cannot fill"):
        parse_mesh_spec("data:-1,model:3", 8)


@pytest.mark.parametrize(
    "spec,shape",
    [
        ("data:8", (8, 1, 1)),
        ("model:2,data:4", (4, 1, 2)),
        ("fsdp:-1", (1, 8, 1)),
        ({"data": 2, "fsdp": 2, "model": 2}, (2, 2, 2)),
    ],
)
def test_make_mesh_axes_always_in_order(spec, shape):
    mesh = make_mesh(spec)
    assert mesh.axis_names == ("data", "fsdp", "model")
    assert tuple(mesh.shape[a] for a in AXES) == shape
    assert mesh.size == 8


def test_make_mesh_on_one_device():
    mesh = make_mesh("data:1", devices=jax.devices()[:1])
    assert mesh.axis_names == ("data", "fsdp", "model")
    assert mesh.size == 1
    assert mesh.devices.flat[0] == jax.devices()[0]


def test_make_mesh_wrong_size_is_config_error():
    with pytest.raises(ConfigError, match="xla_force_host_platform_device_count"):
        make_mesh("data:8", devices=jax.devices()[:4])


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: make_mesh(""), "mesh spec '' is empty"),
        (lambda: make_mesh({}), "mesh spec '' is empty"),
        (lambda: make_mesh(8), r"make_mesh\(8\): the spec must be a string .* not int"),
        (lambda: make_mesh("data:-1", devices=[]), "the device list is empty"),
        (lambda: Rules(fsdp_min_size="1024"), r"fsdp_min_size='1024'.*an int >= 0"),
        (lambda: Rules(fsdp_min_size=-5), r"fsdp_min_size=-5.*an int >= 0"),
        # a logical table's entries are (name, axis) pairs, the axis a name, names or None
        (lambda: Rules(logical={"mlp": 5}), r"logical=...\): entry \('mlp', 5\) is not a"),
        (lambda: Rules(logical=(("mlp",),)), r"entry \('mlp',\) is not a \(logical_name, m"),
        (lambda: Rules(logical=("mlp", "model")), r"entry 'mlp' is not a \(logical_name, m"),
        (lambda: Rules(logical="mlp"), r"Rules\(logical='mlp'\): give a tuple of pairs or a"),
    ],
)
def test_bad_library_arguments_are_config_errors(call, needle):
    with pytest.raises(ConfigError, match=needle):
        call()


# ----------------------------------------------------------------------------- path rules


def test_first_matching_rule_wins(mesh_dm):
    tree = {"enc": {"kernel": sds(8, 4)}, "dec": {"kernel": sds(8, 4)}}
    rules = Rules(path=((r"enc/kernel$", ("data", None)), (r"kernel$", (None, "model"))))
    s = infer_shardings(tree, rules, mesh_dm)
    assert s["enc"]["kernel"].spec == P("data", None)
    assert s["dec"]["kernel"].spec == P(None, "model")
    # The same rules in the other order: the broad rule now shadows the specific one.
    with pytest.warns(UserWarning, match=r"'enc/kernel\$' matches 'enc/kernel' but places none"):
        s2 = infer_shardings(tree, Rules(path=tuple(reversed(rules.path))), mesh_dm)
    assert s2["enc"]["kernel"].spec == P(None, "model")


def test_plain_sequence_of_pairs_is_accepted(mesh_dm):
    tree = {"a": sds(8, 4), "b": sds(8, 4)}
    s = infer_shardings(tree, [(r"^a$", ("data",)), (r"^b$", (None, "model"))], mesh_dm)
    assert isinstance(s["a"], NamedSharding)
    assert s["a"].mesh is mesh_dm
    assert s["a"].spec == P("data", None)
    assert s["b"].spec == P(None, "model")


def test_infer_spec_takes_a_plain_sequence_of_pairs_as_infer_shardings_does(mesh_dm):
    pairs = [(r"head/kernel$", (None, "model"))]
    assert infer_spec("params/head/kernel", (64, 10), pairs, mesh_dm) == P(None, "model")
    assert infer_spec("params/head/kernel", (64, 10), Rules(path=tuple(pairs)), mesh_dm) == P(
        None, "model"
    )


def test_path_and_logical_rules_may_be_dicts_read_in_order(mesh_dm):
    """A dict's items, in order, as the pairs would be. Planted bug that fails it: the dict
    iterated as it is (its keys: "hd" read as the pair ("h", "d"), the kernel replicated)."""
    path = {r"enc/kernel$": ("data", None), r"kernel$": (None, "model")}
    assert Rules(path=path) == Rules(path=tuple(path.items()))
    tree = {"enc": {"kernel": sds(8, 4)}, "dec": {"kernel": sds(8, 4)}}
    s = infer_shardings(tree, Rules(path=path), mesh_dm)
    assert (s["enc"]["kernel"].spec, s["dec"]["kernel"].spec) == (P("data", None), P(None, "model"))
    assert infer_shardings(tree, path, mesh_dm) == s  # as a plain sequence of pairs is
    box = {"w": nn.LogicallyPartitioned(sds(8, 4), ("in", "hd"))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "logical name 'h' is on no array"
        s = infer_shardings(box, Rules(logical={"in": None, "hd": "model"}), mesh_dm)
    assert s["w"].spec == P(None, "model")


def test_short_spec_pads_with_none(mesh_dm):
    s = infer_shardings({"w": sds(4, 3, 5)}, [(r"w", ("data",))], mesh_dm)
    assert tuple(s["w"].spec) == ("data", None, None)


def test_spec_longer_than_array_is_error(mesh_dm):
    with pytest.raises(ConfigError, match="entries"):
        infer_shardings({"w": sds(4)}, [(r"w", ("data", None))], mesh_dm)


def test_factored_optimizer_statistics_need_a_rule_of_their_own(mesh_dm):
    """Adafactor's v_row/v_col sit under the parameter's path with fewer dimensions: the
    parameter's rule cannot place them, and the error says why and gives the rule that
    does. Planted bug that fails it: the error without its why and how."""
    params = {"enc": {"kernel": sds(16, 8), "bias": sds(8)}}
    state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=4).init, params)
    rule = (r"enc/kernel$", (None, "model"))
    expect = (
        r"'1/0/v_row/enc/kernel': spec \(None, 'model'\) has 2 entries but the array has shape "
        r"\(8,\) \(rule 'enc/kernel\$'\); the regex also matches arrays of fewer dimensions"
        r".*Adafactor's v_row, v_col, v\): put a rule of their own before it, e.g. \(r'\(\^\|/"
    )
    with pytest.raises(ConfigError, match=expect):
        infer_shardings((params, state), [rule], mesh_dm)
    # the rule the message (and docs/parallelism.md) gives
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s_params, s_state = infer_shardings((params, state), [(r"(^|/)v(_row|_col)?/", ()), rule],
                                            mesh_dm)  # fmt: skip
    assert s_params["enc"]["kernel"].spec == P(None, "model")
    assert s_state[0].v_row["enc"]["kernel"].spec == P(None)
    assert s_state[0].v["enc"]["kernel"].spec == P(None)


def test_tuple_entry_shards_one_dim_over_two_axes(mesh_dfm):
    s = infer_shardings({"w": sds(16, 3)}, [(r"w", (("data", "fsdp"), None))], mesh_dfm)
    assert s["w"].spec == P(("data", "fsdp"), None)
    # 4 shards of 4 rows each along dim 0
    shard_shape = s["w"].shard_shape((16, 3))
    assert shard_shape == (4, 3)


def test_unmatched_arrays_are_replicated(mesh_dm):
    s = infer_shardings({"w": sds(8, 4), "b": sds(4)}, [(r"^w$", ("data",))], mesh_dm)
    assert s["b"].spec == P(None)
    assert s["b"].is_fully_replicated


def test_non_dividing_rule_names_path_shape_and_axis(mesh_dm):
    tree = {"layer": {"w": sds(6, 3)}}
    with pytest.raises(ConfigError) as e:
        infer_shardings(tree, [(r"w$", ("data",))], mesh_dm)
    msg = str(e.value)
    assert "layer/w" in msg
    assert "(6, 3)" in msg
    assert "mesh axis 'data' (size 4)" in msg


def test_non_dividing_tuple_entry_names_both_axes(mesh_dfm):
    with pytest.raises(ConfigError) as e:
        infer_shardings({"w": sds(10, 3)}, [(r"w", (("data", "fsdp"),))], mesh_dfm)
    msg = str(e.value)  # 10 rows over data x fsdp = 4 shards
    assert "mesh axes ('data', 'fsdp') (size 4)" in msg and "(10, 3)" in msg


def test_rule_with_unknown_mesh_axis(mesh_dm):
    with pytest.raises(ConfigError) as e:
        infer_shardings({"w": sds(8, 4)}, [(r"w", ("tensor", None))], mesh_dm)
    assert "tensor" in str(e.value)


def test_spec_naming_an_axis_twice_is_config_error(mesh_dm):
    with pytest.raises(
        ConfigError, match=r"'w'.*\('model', 'model'\).*'model' more than once.*rule"
    ):
        infer_shardings({"w": sds(8, 4)}, [(r"w", ("model", "model"))], mesh_dm)
    # the same through two logical names mapped to one axis
    box = {"w": nn.LogicallyPartitioned(sds(8, 4), ("embed", "classes"))}
    rules = Rules(logical=(("embed", "model"), ("classes", "model")))
    with pytest.raises(ConfigError, match=r"'w'.*more than once.*logical axes"):
        infer_shardings(box, rules, mesh_dm)


def test_bare_string_spec_is_config_error(mesh_dm):
    with pytest.raises(ConfigError, match=r"'b'.*spec 'model' is a string.*one entry per dim"):
        infer_shardings({"b": sds(16)}, [(r"b$", "model")], mesh_dm)


# ----------------------------------------------------------------------------- logical rules


def _dense_shapes(features=8):
    module = nn.Dense(
        features,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("embed", "classes")
        ),
    )
    return jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 16), F32))


def test_logical_table_for_boxed_leaves(mesh_dm):
    shapes = _dense_shapes()
    assert isinstance(shapes["params"]["kernel"], nn.LogicallyPartitioned)
    s = infer_shardings(shapes, Rules(logical=(("classes", "model"),)), mesh_dm)
    # unboxed structure: the kernel's sharding is a NamedSharding, not a box
    assert isinstance(s["params"]["kernel"], NamedSharding)
    assert s["params"]["kernel"].spec == P(None, "model")
    assert s["params"]["bias"].spec == P(None)


def test_logical_first_entry_for_a_name_wins(mesh_dm):
    rules = Rules(logical=(("classes", "model"), ("classes", "data")))
    s = infer_shardings(_dense_shapes(), rules, mesh_dm)
    assert s["params"]["kernel"].spec == P(None, "model")


def test_path_rules_take_priority_over_logical(mesh_dm):
    rules = Rules(path=((r"kernel$", ("data", None)),), logical=(("classes", "model"),))
    s = infer_shardings(_dense_shapes(), rules, mesh_dm)
    assert s["params"]["kernel"].spec == P("data", None)


def test_logical_rule_that_does_not_divide(mesh_dm):
    with pytest.raises(ConfigError) as e:
        infer_shardings(_dense_shapes(features=9), Rules(logical=(("classes", "model"),)), mesh_dm)
    msg = str(e.value)
    assert "params/kernel" in msg and "(16, 9)" in msg and "model" in msg


def test_logical_names_the_table_does_not_map_are_warned_naming_them(mesh_dm):
    """A linen logical name that the table lacks replicates its dimension, as a name mapped to
    None does; that one is silent, a missing one (an empty table, a forgotten or misspelt
    key) is warned about, naming the arrays and the names and how to map them. An array a
    path rule places is not, nor a call with unmatched="ignore". Planted bugs that fail it:
    the warning left out (the old silence); an empty table skipped (the old ``and
    rules.logical``); a name mapped to None counted as missing."""
    tree = {"mlp": {"kernel": nn.LogicallyPartitioned(sds(16, 8), ("embed", "mlp"))}}
    for rules, missing in [
        (Rules(), "'embed', 'mlp'"),
        (Rules(logical={"embed": None}), "'mlp'"),
        (Rules(logical={"embed": None, "mpl": "model"}), "'mlp'"),  # a misspelt key
    ]:
        with pytest.warns(UserWarning) as record:
            s = infer_shardings(tree, rules, mesh_dm)
        msg = "\n".join(str(w.message) for w in record)
        assert f"'mlp/kernel': 1 array carries logical name(s) {missing} that the rules' " in msg
        assert "Rules(logical={" in msg and "None replicates without this warning" in msg
        assert s["mlp"]["kernel"].spec == P(None, None)
        with pytest.warns(UserWarning, match=f"logical name\\(s\\) {missing} that"):
            spec = infer_spec("mlp/kernel", (16, 8), rules, mesh_dm, ("embed", "mlp"))
        assert spec == P(None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = infer_shardings(tree, Rules(logical={"embed": None, "mlp": "model"}), mesh_dm)
        assert s["mlp"]["kernel"].spec == P(None, "model")
        assert infer_shardings(tree, Rules(logical={"embed": None, "mlp": None}), mesh_dm)[
            "mlp"
        ]["kernel"].spec == P(None, None)
        assert infer_shardings(tree, [(r"kernel$", (None, "model"))], mesh_dm)["mlp"][
            "kernel"
        ].spec == P(None, "model")  # placed by a path rule: its names are not used
        infer_shardings(tree, Rules(), mesh_dm, unmatched="ignore")


def test_a_rule_matching_nothing_shows_paths_of_the_tree_given():
    """The example of what paths look like is the tree's own, not a linen 'params/...' one.
    Planted bug that fails it: the fixed 'params/Dense_0/kernel' example."""
    tree = [{"head": {"kernel": sds(4, 2)}}]
    message = unmatched_rules(tree, [(r"haed/kernel$", (None, "model"))])
    assert "this tree's paths look like '0/head/kernel'" in message
    assert "params/" not in message
    empty = unmatched_rules({}, [(r"x$", ())])
    assert empty == "path rule 'x$' matches no array (the tree has none)"


# ----------------------------------------------------------------------------- FSDP pass


def test_fsdp_shards_largest_divisible_dim(mesh_fsdp):
    tree = {
        "big": sds(16, 32),  # both divide 8: largest (32) gets fsdp
        "mixed": sds(16, 30),  # 30 does not divide 8: falls back to 16
        "small": sds(4, 4),  # below min size: replicated
        "odd": sds(9, 15),  # big enough, nothing divides: replicated
        "vec": sds(64),
    }
    with pytest.warns(UserWarning) as record:
        s = infer_shardings(tree, Rules(fsdp_min_size=64), mesh_fsdp)
    # the one array big enough that stays whole is named, with what it costs each device
    (w,) = record
    msg = str(w.message)
    assert msg.startswith("'odd': 1 array of at least fsdp_min_size=64 elements (0.5 KiB)")
    assert "fsdp=8 divides none" in msg
    assert s["big"].spec == P(None, "fsdp")
    assert s["mixed"].spec == P("fsdp", None)
    assert s["small"].spec == P(None, None)
    assert s["odd"].spec == P(None, None)
    assert s["vec"].spec == P("fsdp")


def test_fsdp_disabled_without_min_size(mesh_fsdp):
    s = infer_shardings({"big": sds(16, 32)}, Rules(), mesh_fsdp)
    assert s["big"].spec == P(None, None)


def test_fsdp_stacks_on_the_dim_a_rule_split(mesh_dfm):
    rules = Rules(path=((r"w", (None, "model")),), fsdp_min_size=1)
    with pytest.warns(UserWarning, match=r"^'w3': 1 array .* \(0\.0 KiB\)"):
        s = infer_shardings({"w": sds(8, 64), "w2": sds(8, 2), "w3": sds(3, 2)}, rules, mesh_dfm)
    # dim 1 is split over model; fsdp goes on the same dim, so gathering over fsdp yields
    # the model-parallel layout (and avoids an XLA conv-gradient bug, see partitioning._fsdp)
    assert s["w"].spec == P(None, ("model", "fsdp"))
    # when model x fsdp does not divide that dim, a 2-D array takes fsdp on a free dim (it
    # stayed whole before: the conv guard is for 4-D kernels only)
    assert s["w2"].spec == P("fsdp", "model")
    assert s["w3"].spec == P(None, "model")  # no free dim divides either


def test_fsdp_splits_a_free_dim_of_split_arrays_but_not_of_split_conv_kernels():
    """A 2-D or 3-D array whose split dimension does not divide by its axes times fsdp takes
    fsdp on its largest free dimension that divides; a 4-D kernel stays as the rules put it
    (fsdp on its input channels is the layout XLA's strided-conv gradient gets wrong), and the
    warning gives the true reason for each. The placed step's gradients equal one device's.
    Planted bugs that fail it: the old ``_fsdp`` (stacking only, so both arrays stay whole);
    the free-dimension fallback applied to 4-D kernels too; one reason for all in the warning."""
    mesh = make_mesh("fsdp:4,model:2")
    tree = {"attn": sds(32, 4, 8), "mlp": sds(32, 6), "conv": sds(3, 3, 8, 6), "odd": sds(6, 6)}
    rules = Rules(
        path=(
            (r"attn", (None, "model", None)),
            (r"mlp|odd", (None, "model")),
            (r"conv", (None, None, None, "model")),
        ),
        fsdp_min_size=0,
    )
    with pytest.warns(UserWarning) as record:
        s = infer_shardings(tree, rules, mesh)
    assert s["attn"].spec == P("fsdp", "model", None)
    assert s["mlp"].spec == P("fsdp", "model")
    assert s["conv"].spec == P(None, None, None, "model")
    assert s["odd"].spec == P(None, "model")
    (w,) = record
    msg = str(w.message)
    assert msg.startswith("'conv', 'odd': 2 arrays of at least fsdp_min_size=0 elements")
    assert "'conv', as no dimension the rules split divides by its axes times fsdp" in msg
    assert "4-D kernel the rules split takes fsdp only on a dimension they split" in msg
    assert "'odd', as no dimension the rules split" in msg
    assert "fsdp=4 divides none of the dimensions they leave free" in msg
    assert "divides none of their dimensions" not in msg  # 4 divides the conv's 8

    # the same loss and gradients as on one device, with the arrays placed so
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    attn, mlp = (rng.standard_normal(tree[k].shape).astype(np.float32) for k in ("attn", "mlp"))

    def loss(attn, mlp, x):
        return jnp.sum(jnp.tanh(jnp.einsum("be,ehd->bhd", x, attn)) ** 2) + jnp.sum(x @ mlp)

    want = jax.grad(loss, argnums=(0, 1))(attn, mlp, x)
    placed = jax.device_put((attn, mlp), (s["attn"], s["mlp"]))
    got = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(s["attn"], s["mlp"]))(*placed, x)
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w_, rtol=1e-5, atol=1e-5)
    assert got[0].sharding.spec == P("fsdp", "model", None)


def test_fsdp_warning_sums_what_stays_whole_and_spares_what_it_split(mesh_fsdp):
    tree = {"a": sds(999, 1025), "b": sds(1023, 1025), "c": sds(1024, 1024), "s": sds()}
    with pytest.warns(UserWarning) as record:
        s = infer_shardings(tree, Rules(fsdp_min_size=1), mesh_fsdp)
    (w,) = record
    # a and b: 2,072,550 float32 values, 7.9 MiB; c split; a scalar never splits
    assert str(w.message).startswith(
        "'a', 'b': 2 arrays of at least fsdp_min_size=1 elements (7.9 MiB)"
    )
    assert s["c"].spec == P(None, "fsdp")


def test_fsdp_pass_on_a_mesh_without_fsdp_devices_warns_once():
    tree = {"w": sds(64, 32), "v": sds(32, 64), "b": sds(32)}  # two arrays of >= 1024
    own = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    for mesh, why in [(make_mesh("data:8"), "has one device"), (own, "is missing")]:
        with pytest.warns(UserWarning) as record:
            s = infer_shardings(tree, FSDP, mesh)
        (w,) = record
        assert str(w.message).startswith(
            "'v', 'w': 2 arrays of at least fsdp_min_size=1024 elements stay whole on every "
            f"device, as the FSDP pass (hybridpar.FSDP's) splits over the fsdp axis, which {why} "
            "on mesh data=8"
        )
        assert all(x.is_fully_replicated for x in jax.tree.leaves(s))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infer_shardings(tree, FSDP, make_mesh("data:4,fsdp:2"))  # splits them
        infer_shardings({"b": sds(32)}, FSDP, make_mesh("data:8"))  # nothing to split
        # rules meant for any mesh (the trainer's, which warns about a moot preset itself)
        infer_shardings(tree, FSDP, make_mesh("data:8"), moot_fsdp="ignore")
    # a part of a tree some rules are not for (optimizer state) still hears of a moot pass
    with pytest.warns(UserWarning, match="stay whole on every device, as the FSDP pass"):
        infer_shardings(tree, FSDP, make_mesh("data:8"), unmatched="ignore")


def test_rules_say_the_axes_they_split_over():
    """Set-up's moot-preset warning reads a preset's axes from its rules (planted: the
    FSDP pass or the logical rules left out)."""
    from hybridpar.parallel.partitioning import HYBRID, TENSOR

    assert (Rules().axes(), FSDP.axes()) == ((), ("fsdp",))
    assert HYBRID.axes() == TENSOR.axes() == ("model",)
    assert Rules(logical=(("classes", ("data", "model")),)).axes() == ("data", "model")
    assert (HYBRID + FSDP).axes() == ("model", "fsdp")


def test_rules_add_a_plain_sequence_of_pairs_on_either_side(mesh_dm):
    rules = Rules(path=((r"w", ("data",)),), fsdp_min_size=4)
    pairs = [(r"w", (None, "model"))]
    assert (rules + pairs).path == ((r"w", ("data",)), (r"w", (None, "model")))
    assert (pairs + rules).path == ((r"w", (None, "model")), (r"w", ("data",)))
    assert (pairs + rules).fsdp_min_size == 4
    placed = infer_shardings({"w": sds(4, 6)}, pairs + rules, mesh_dm, unmatched="ignore")
    assert placed["w"].spec == P(None, "model")  # (the rule after it places nothing)


# ----------------------------------------------------------------------------- warnings


def test_kernel_split_on_both_channel_dims_warns(mesh_dfm):
    tree = {"a": {"kernel": sds(1, 1, 16, 32)}, "b": {"kernel": sds(1, 1, 32, 64)}}
    rules = Rules(
        path=(
            (r"a/kernel$", (None, None, None, "model")),
            (r"b/kernel$", (None, None, "fsdp", "model")),
        )
    )
    with pytest.warns(UserWarning) as record:
        infer_shardings(tree, rules, mesh_dfm)
    (w,) = record
    msg = str(w.message)
    assert "'b/kernel'" in msg and "'a/kernel'" not in msg
    assert "strided" in msg and "('model', 'fsdp')" in msg
    # one split channel dimension, or the second axis stacked on the same one: no warning
    for spec in [(None, None, "fsdp", None), (None, None, None, ("model", "fsdp"))]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            infer_shardings(tree, Rules(path=((r"kernel$", spec),)), mesh_dfm)


@pytest.mark.parametrize("model_name", ["resnet_tiny", "airbench"])
def test_presets_never_split_a_kernel_on_both_channel_dims(model_name):
    model = create_model(model_name, num_classes=16)
    x = jnp.zeros((1, 32, 32, 3), F32)
    tree = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
    for spec in ["data:8", "fsdp:8", "data:4,model:2", "data:2,fsdp:2,model:2"]:
        mesh = make_mesh(spec)
        for preset in ["data", "fsdp", "hybrid", "tensor", "auto"]:
            for extra in [Rules(), Rules(fsdp_min_size=1024)]:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    rules = preset_rules(preset, mesh) + extra
                    infer_shardings(tree, rules, mesh, unmatched="ignore", moot_fsdp="ignore")


def test_rules_that_match_nothing_warn_naming_them(mesh_dm):
    rules = Rules(
        path=((r"kernal$", (None, "model")), (r"kernel$", ("data", None))),
        logical=(("clases", "model"), ("classes", "model")),
    )
    with pytest.warns(UserWarning) as record:
        s = infer_shardings(_dense_shapes(), rules, mesh_dm)
    (w,) = record
    msg = str(w.message)
    assert "'kernal$' matches no array" in msg and "'params/kernel'" in msg
    assert "'clases' on no array" in msg and "'kernel$'" not in msg
    assert s["params"]["kernel"].spec == P("data", None)
    # every rule matches, or the caller says some may not: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infer_shardings(_dense_shapes(), Rules(rules.path[1:], rules.logical[1:]), mesh_dm)
        infer_shardings(_dense_shapes(), rules, mesh_dm, unmatched="ignore")


def test_a_rule_earlier_rules_take_every_array_from_warns_naming_them(mesh_dm):
    tree = {"params": {"fc1": {"kernel": sds(8, 4)}, "head": {"kernel": sds(4, 2)}}}
    rules = [(r"kernel$", (None, None)), (r"head/kernel$", (None, "model"))]
    with pytest.warns(UserWarning) as record:
        s = infer_shardings(tree, rules, mesh_dm)
    (w,) = record
    assert str(w.message) == (
        "partitioning rules that place nothing: path rule 'head/kernel$' matches "
        "'params/head/kernel' but places none of them: the earlier rule(s) 'kernel$' match "
        "them first (the first match wins); put it before them, or drop it"
    )
    assert s["params"]["head"]["kernel"].spec == P(None, None)
    # the specific rule first: each rule places some array, silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = infer_shardings(tree, rules[::-1], mesh_dm)
    assert s["params"]["head"]["kernel"].spec == P(None, "model")


@pytest.mark.parametrize(
    "rules, expect",
    [
        (((r"stage9_block0/conv1/kernel$", (None, None, None, "model")),),
         r"path rule 'stage9.*'params/stage"),
        (((r"conv1/kernel$", (None,) * 4), (r"stage1_block0/conv1/kernel$", (None,) * 4)),
         r"path rule 'stage1_block0/conv1/kernel\$' matches .* the earlier rule\(s\) 'conv1"),
    ],
)  # fmt: skip
def test_trainer_own_rule_that_places_nothing_is_config_error(rules, expect):
    config = tiny_config(mesh="data:4,model:2")
    config.partitioning.rules = rules
    with pytest.raises(ConfigError, match=r"partitioning.rules: " + expect):
        build(config)


def test_trainer_own_logical_name_on_no_array_warns():
    config = tiny_config(mesh="data:4,model:2")
    config.partitioning.logical_rules = (("clases", "model"),)
    with pytest.warns(UserWarning, match=r"partitioning.logical_rules: .*'clases' on no array"):
        build(config)


@pytest.mark.parametrize("mesh, preset", [("data:4,model:2", "auto"), ("data:8", "fsdp")])
def test_trainer_presets_that_match_nothing_stay_silent(mesh, preset):
    # airbench has no stage-3/4 convolutions for the hybrid preset's conv rule; fsdp on a
    # mesh without fsdp devices splits nothing, which the trainer warns about itself
    # (runtime.run.moot_on_mesh), so infer_shardings must not warn a second time
    config = tiny_config(mesh=mesh)
    config.model.name = "airbench"
    config.partitioning.preset = preset
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        build(config)


# ----------------------------------------------------------------------------- pytrees


def test_plain_nested_dict_of_numpy_arrays(mesh_dm):
    tree = {
        "outer": {
            "inner": {"kernel": np.zeros((8, 4), np.float32)},
            "bias": np.zeros((4,), np.float32),
        }
    }
    s = infer_shardings(tree, [(r"outer/inner/kernel$", ("data", "model"))], mesh_dm)
    assert s["outer"]["inner"]["kernel"].spec == P("data", "model")
    assert s["outer"]["bias"].spec == P(None)
    assert jax.tree.structure(s) == jax.tree.structure(tree)


def test_lists_and_tuples(mesh_dm):
    tree = [sds(8, 4), (sds(4, 2), {"k": sds(2, 8)})]
    rules = [(r"^0$", ("data",)), (r"^1/0$", (None, "model")), (r"^1/1/k$", (None, "data"))]
    s = infer_shardings(tree, rules, mesh_dm)
    assert isinstance(s, list) and isinstance(s[1], tuple)
    assert s[0].spec == P("data", None)
    assert s[1][0].spec == P(None, "model")
    assert s[1][1]["k"].spec == P(None, "data")


def test_shardings_place_real_arrays(mesh_dm):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    s = infer_shardings({"w": x}, [(r"w", ("data", "model"))], mesh_dm)
    y = jax.device_put(x, s["w"])
    assert y.sharding.shard_shape(x.shape) == (2, 2)
    np.testing.assert_array_equal(np.asarray(y), x)


def _nnx_state():
    return nnx.state(nnx.Linear(16, 32, rngs=nnx.Rngs(0)))


def test_nnx_state_gives_named_shardings(mesh_dm):
    state = _nnx_state()
    s = infer_shardings(state, Rules(), mesh_dm)
    leaves = jax.tree.leaves(s)
    assert len(leaves) == 2
    assert all(isinstance(x, NamedSharding) for x in leaves)
    # One sharding per Variable: a valid out_shardings prefix of the State.
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    assert jax.tree.structure(s) == jax.tree.structure(
        jax.tree.map(lambda v: 0, state, is_leaf=is_var)
    )


def test_nnx_state_respects_path_rules(mesh_dm):
    s = infer_shardings(_nnx_state(), [(r"kernel$", (None, "model"))], mesh_dm)
    (kernel,) = jax.tree.leaves(s["kernel"])
    (bias,) = jax.tree.leaves(s["bias"])
    assert bias.spec == P(None)
    assert kernel.spec == P(None, "model")


class _AnnotatedNet(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.fc = nnx.Linear(
            64, 32, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs
        )
        self.head = nnx.Linear(
            32, 16, kernel_init=nnx.with_partitioning(init, ("embed", "classes")), rngs=rngs
        )


def test_nnx_partitioning_annotations_are_used(mesh_dm, mesh_dfm):
    with nnx.use_eager_sharding(False):  # annotate only; no mesh to place on at creation
        state = nnx.state(nnx.eval_shape(lambda: _AnnotatedNet(nnx.Rngs(0))))
    table = Rules(logical=(("classes", "model"), ("embed", None)))
    s = infer_shardings(state, table, mesh_dm)
    assert s["fc"]["kernel"].spec == P(None, "model")  # a mesh axis, as it is
    assert s["head"]["kernel"].spec == P(None, "model")  # logical names, through the table
    # path rules go first; the FSDP pass stacks on top
    s = infer_shardings(state, Rules(path=((r"fc/kernel$", ("data", None)),)) + table, mesh_dm)
    assert s["fc"]["kernel"].spec == P("data", None)
    s = infer_shardings(state, table + Rules(fsdp_min_size=1), mesh_dfm)
    assert s["fc"]["kernel"].spec == P(None, ("model", "fsdp"))
    # a name that is neither a mesh axis nor in the table
    with pytest.raises(ConfigError, match=r"'head/kernel'.*names 'embed'"):
        infer_shardings(state, Rules(logical=(("classes", "model"),)), mesh_dm)


def _partitioned_dense():
    module = nn.Dense(
        64, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    )
    return jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 64), F32))


def test_partitioned_leaves_take_path_rules_first_and_fsdp_on_top(mesh_dm, mesh_dfm):
    tree = _partitioned_dense()
    assert isinstance(tree["params"]["kernel"], nn.Partitioned)
    assert infer_shardings(tree, Rules(), mesh_dm)["params"]["kernel"].spec == P(None, "model")
    rules = Rules(path=((r"kernel$", ("model", None)),))
    assert infer_shardings(tree, rules, mesh_dm)["params"]["kernel"].spec == P("model", None)
    s = infer_shardings(tree, Rules(fsdp_min_size=1024), mesh_dfm)
    assert s["params"]["kernel"].spec == P(None, ("model", "fsdp"))
    odd = {"w": nn.Partitioned(sds(8, 9), (None, "model"))}
    with pytest.raises(ConfigError, match=r"'w' with shape \(8, 9\).*does not divide"):
        infer_shardings(odd, Rules(), mesh_dm)


# ----------------------------------------------------------------------------- presets


def _head_tree():
    box = nn.LogicallyPartitioned(sds(16, 8), ("embed", "classes"))
    return {
        "params": {"head": {"kernel": box, "bias": sds(8)}, "stem": {"kernel": sds(3, 3, 3, 64)}}
    }


def test_auto_preset_on_data_mesh_shards_no_params():
    mesh = make_mesh("data:8")
    rules = preset_rules("auto", mesh)
    s = infer_shardings(_head_tree(), rules, mesh)
    assert all(x.is_fully_replicated for x in jax.tree.leaves(s))


def test_auto_preset_on_fsdp_mesh_shards_over_fsdp(mesh_fsdp):
    tree = {"params": {"big": sds(64, 128), "bias": sds(128)}}
    s = infer_shardings(tree, preset_rules("auto", mesh_fsdp), mesh_fsdp)
    assert "fsdp" in tuple(s["params"]["big"].spec)
    assert s["params"]["bias"].is_fully_replicated  # small


def test_auto_preset_on_hybrid_mesh_puts_head_over_model(mesh_dm):
    # unmatched="ignore": the tree has no stage-3/4 convolutions for the conv rule
    s = infer_shardings(_head_tree(), preset_rules("auto", mesh_dm), mesh_dm, unmatched="ignore")
    assert s["params"]["head"]["kernel"].spec == P(None, "model")
    assert s["params"]["stem"]["kernel"].is_fully_replicated


def test_hybrid_preset_shards_stage3_convs(mesh_dm):
    tree = {
        "params": {
            "stage3_block0": {"conv2": {"kernel": sds(3, 3, 8, 8)}},
            "stage1_block0": {"conv2": {"kernel": sds(3, 3, 8, 8)}},
        }
    }
    s = infer_shardings(tree, preset_rules("hybrid", mesh_dm), mesh_dm, unmatched="ignore")
    assert s["params"]["stage3_block0"]["conv2"]["kernel"].spec == P(None, None, None, "model")
    assert s["params"]["stage1_block0"]["conv2"]["kernel"].is_fully_replicated


def test_unknown_preset(mesh_dm):
    with pytest.raises(ConfigError) as e:
        preset_rules("pipeline", mesh_dm)
    assert "auto" in str(e.value) and "hybrid" in str(e.value)


def test_rules_add_keeps_priority_order(mesh_dm):
    a = Rules(path=((r"w", ("data", None)),), logical=(("classes", "model"),), fsdp_min_size=100)
    b = Rules(path=((r"w", (None, "model")),), logical=(("classes", None),), fsdp_min_size=10)
    ab, ba = a + b, b + a
    assert ab.path == a.path + b.path
    assert ab.logical == a.logical + b.logical
    assert ab.fsdp_min_size == 10
    assert (a + Rules()).fsdp_min_size == 100
    # the documented way to raise it on a sum: replace it
    raised = dataclasses.replace(ab, fsdp_min_size=1000)
    assert (raised.path, raised.logical, raised.fsdp_min_size) == (ab.path, ab.logical, 1000)
    assert (Rules() + Rules()).fsdp_min_size is None
    tree = {"w": sds(8, 4)}
    assert infer_shardings(tree, ab, mesh_dm, unmatched="ignore")["w"].spec == P("data", None)
    assert infer_shardings(tree, ba, mesh_dm, unmatched="ignore")["w"].spec == P(None, "model")
    box_tree = {"k": nn.LogicallyPartitioned(sds(16, 8), ("embed", "classes"))}
    assert infer_shardings(box_tree, Rules(logical=a.logical) + Rules(logical=b.logical), mesh_dm)[
        "k"
    ].spec == P(None, "model")
    assert infer_shardings(box_tree, Rules(logical=b.logical) + Rules(logical=a.logical), mesh_dm)[
        "k"
    ].spec == P(None, None)


# ----------------------------------------------------------------------------- shard_batch


def test_shard_batch_makes_global_arrays(mesh_dfm):
    batch = {
        "image": np.arange(8 * 2 * 2 * 1, dtype=np.uint8).reshape(8, 2, 2, 1),
        "label": np.arange(8, dtype=np.int32),
    }
    out = shard_batch(batch, mesh_dfm)
    for k, x in batch.items():
        y = out[k]
        assert isinstance(y, jax.Array)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert y.sharding.spec == P(("data", "fsdp"), *([None] * (x.ndim - 1)))
        # 4 data-parallel shards of 2 examples, each replicated over model
        assert y.sharding.shard_shape(y.shape)[0] == 2
        np.testing.assert_array_equal(np.asarray(y), x)


def test_shard_batch_rejects_indivisible_batch(mesh_dfm):
    with pytest.raises(ConfigError) as e:
        shard_batch({"label": np.arange(6, dtype=np.int32)}, mesh_dfm)
    assert "label" in str(e.value)


@pytest.mark.parametrize("rules", [[(r"w[", (None,))], Rules(path=((r"(x", ()),))])
def test_rule_regex_that_does_not_compile_names_the_rule(mesh_dm, rules):
    with pytest.raises(
        ConfigError, match=r"partitioning rule \('(w\[|\(x)', \(.*\)\): .* not a regex"
    ):
        infer_shardings({"w": sds(4, 4)}, rules, mesh_dm)


def test_rule_that_is_not_a_pair_names_it(mesh_dm):
    with pytest.raises(ConfigError, match=r"rule 'w' is not a \(path_regex, spec\) pair"):
        infer_shardings({"w": sds(4, 4)}, Rules(path=("w",)), mesh_dm)


def test_shard_batch_placed_array_that_does_not_divide(mesh_dm):
    x = jax.device_put(np.zeros((12, 3), np.float32), NamedSharding(mesh_dm, P("data")))
    with pytest.raises(ConfigError, match=r"'x' has leading size 12.*8 data-parallel shards"):
        shard_batch({"x": x}, make_mesh("data:8"))


def test_shard_batch_host_array_that_does_not_divide_names_its_size(mesh_dm):
    with pytest.raises(ConfigError, match=r"'image' has leading size 30 on this host.*4 data"):
        shard_batch({"image": np.zeros((30, 2), np.float32)}, mesh_dm)


def test_shard_batch_rejects_a_python_list(mesh_dm):
    with pytest.raises(ConfigError, match=r"'label' is a Python list.*numpy array"):
        shard_batch({"label": list(range(8))}, mesh_dm)
    # a tuple of arrays is a batch, not a list of numbers
    out = shard_batch((np.zeros((8, 2), np.float32), np.zeros(8, np.int32)), mesh_dm)
    assert out[1].shape == (8,)


@pytest.mark.parametrize("model_name", ["resnet_tiny", "airbench"])
def test_a_preset_on_hybridpars_models_warns_of_no_logical_name(model_name):
    """The presets map every logical name hybridpar's models carry (to None where they do
    not split it): a preset on them, with the default warnings, says nothing of names the
    table lacks or of table keys on no array (the presets' rules are for every model).
    Planted bug that fails it: the presets without MODEL_NAMES."""
    model = create_model(model_name, num_classes=16)
    x = jnp.zeros((1, 32, 32, 3), F32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))["params"]
    for spec in ["data:8", "fsdp:8", "data:4,model:2", "data:2,fsdp:2,model:2"]:
        mesh = make_mesh(spec)
        for preset in ["data", "fsdp", "hybrid", "tensor", "auto"]:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                infer_shardings(params, preset_rules(preset, mesh), mesh, moot_fsdp="ignore")
            said = [str(w.message) for w in record if "logical" in str(w.message)]
            assert not said, (spec, preset, said)


def test_a_users_mapping_wins_over_a_presets_default_on_either_side(mesh_dm):
    """The presets map hybridpar's models' logical names (MODEL_NAMES) to None; a user's own
    mapping of such a name (t5x and MaxText name 'embed' too) wins wherever it stands in
    the sum: 'FSDP + mine' split nothing, the preset's None coming first. Planted bug that
    fails it: the defaults taken in order like any entry."""
    tree = {"mlp": {"kernel": nn.LogicallyPartitioned(sds(16, 8), ("embed", "mlp"))}}
    mine = Rules(logical={"embed": "model", "mlp": None})
    for rules in (FSDP + mine, mine + FSDP, preset_rules("auto", mesh_dm) + mine):
        s = infer_shardings(tree, rules, mesh_dm)
        assert s["mlp"]["kernel"].spec == P("model", None), rules
