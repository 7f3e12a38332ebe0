"""The probe registry and the ``--probes`` syntax: parse_named item by item, parameter values and
names, errors that name the fix, and what a probe records beside its scores."""

from __future__ import annotations

import pytest

from rankkit.errors import RankkitError
from rankkit.probes import REGISTRY, make, parse_named, parse_probes
from rankkit.probes.last_token_heads import LastTokenHeadsProbe
from rankkit.probes.last_token_raw import LastTokenRawProbe
from rankkit.probes.window import WindowProbe


def test_parse_named_reads_names_and_their_parameters_in_order():
    assert parse_named("window:w=32,kernel=7,last_token_raw") == [
        ("window", {"window_size": 32, "kernel_size": 7}),
        ("last_token_raw", {}),
    ]
    assert parse_named(" a : x = 1 ,, b ,c:y=2, z=3,") == [
        ("a", {"x": 1}),
        ("b", {}),
        ("c", {"y": 2, "z": 3}),
    ]
    # a parameter belongs to the name right before it, however many came earlier
    assert parse_named("a,b,c,k=1") == [("a", {}), ("b", {}), ("c", {"k": 1})]


def test_parameter_values_are_int_float_or_text():
    ((_, params),) = parse_named("p:count=3,rate=0.5,big=1e3,mode=max,empty=,ratio=a=b")
    assert params == {"count": 3, "rate": 0.5, "big": 1000.0, "mode": "max", "empty": "", "ratio": "a=b"}
    assert type(params["count"]) is int and type(params["big"]) is float
    assert parse_named("p:time=1:30") == [("p", {"time": "1:30"})]  # the first colon ends the name


def test_short_and_full_parameter_names():
    assert parse_named("window:w=4,kernel_size=9,other=1") == [
        ("window", {"window_size": 4, "kernel_size": 9, "other": 1})
    ]
    # a parameter named twice, under its short name or its full one: the last won, the label lied
    with pytest.raises(RankkitError, match="window_size is given twice in 'window:w=4,window_size=5'"):
        parse_named("window:w=4,window_size=5")


@pytest.mark.parametrize(
    "spec, what, message",
    [
        ("w=32,window", "probe", "parameter 'w=32' comes before any probe; give comma-separated names"),
        ("k=1", "method", "parameter 'k=1' comes before any method; give"),
        (" , ,", "probe", "no probe named; give comma-separated names"),
        ("", "method", "no method named; give"),
    ],
)
def test_parse_named_refuses_what_it_cannot_read(spec, what, message):
    with pytest.raises(RankkitError, match=message):
        parse_named(spec, what)


def test_parse_named_speaks_of_probes_by_default():
    with pytest.raises(RankkitError, match="before any probe;"):
        parse_named("w=1")
    with pytest.raises(RankkitError, match="no probe named"):
        parse_named(",")


def test_make_names_the_known_probes_and_the_bad_parameter():
    with pytest.raises(RankkitError, match="unknown probe 'snapkv'; known: " + ", ".join(sorted(REGISTRY))):
        make("snapkv")
    with pytest.raises(RankkitError, match="probe 'window' has no parameter 'size'; it takes window_size, kernel_size, pooling$"):
        make("window", size=3)
    with pytest.raises(RankkitError, match="probe 'last_token_heads' has no parameter 'pooling'; it takes none$"):
        make("last_token_heads", pooling="max")
    with pytest.raises(RankkitError, match="window_size must be an integer of at least 1, not 'wide'$"):
        make("lava", window_size="wide")  # a text value of --probes lava:w=wide, not a comparison's TypeError


def test_a_method_names_the_parameters_it_takes():
    from rankkit.methods import make as make_method

    with pytest.raises(RankkitError, match="method 'snapkv' has no parameter 'window'; it takes window_size, kernel_size$"):
        make_method("snapkv", window=8)
    with pytest.raises(RankkitError, match="method 'full' has no parameter 'keep'; it takes none$"):
        make_method("full", keep=0.1)


def test_parse_probes_all_and_settings():
    assert parse_probes(" all ") == [make(name) for name in REGISTRY]
    assert parse_probes("window:w=16,last_token_heads,window") == [
        WindowProbe(window_size=16),
        LastTokenHeadsProbe(),
        WindowProbe(),
    ]


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ("window, last_token_raw,window", "window"),
        ("window:w=8,window:window_size=8", "window"),  # w=8 is window's default
        ("lava:w=16,lava:w=16,pooling=max", "lava:w=16"),
    ],
)
def test_a_probe_setting_named_twice_is_refused_in_any_spelling(spec, key):
    """A sweep file's probe list refuses a repeat; the command line kept the first and dropped the
    second without a word, so two spellings of one setting recorded one array."""
    with pytest.raises(RankkitError, match=rf"names the probe setting '{key}' twice .* name each probe once$"):
        parse_probes(spec)


def test_what_a_probe_records_beside_its_scores():
    probe = LastTokenRawProbe(kernel_size=7)
    assert probe.params() == {"probe": "last_token_raw", "kernel_size": 7, "pooling": "avg_padded"}
    assert probe.key == "last_token_raw:kernel=7"
    assert probe.layout() == {
        "pooling": "avg_padded",
        "kernel_size": 7,
        "unpooled_last": 0,
        "layout": "pooled before the last min(unpooled_last, T) positions, unpooled sums at them",
    }
    assert LastTokenHeadsProbe().params() == {"probe": "last_token_heads"}
    assert LastTokenHeadsProbe().layout() == {}


@pytest.mark.parametrize("params", [{"kernel_size": 4}, {"pooling": "median"}, {"kernel_size": 0}])
def test_last_token_raw_refuses_bad_pooling(params):
    with pytest.raises(RankkitError):
        LastTokenRawProbe(**params)


def test_a_default_capture_records_the_probe_of_every_method_that_has_an_offline_face():
    """Once per store key: SnapKV, AdaKV, PyramidKV and ASL share their 32-token window, FastKV and
    CLAA the 8-token one, TOVA and SAGE-KV the last token's heads; ``full`` and StreamingLLM rank
    nothing stored, and the oracle and SpecPrefill read arrays that are not probes."""
    from rankkit.methods import probes_methods_need

    keys = [probe.key for probe in probes_methods_need()]
    assert sorted(keys) == [
        "last_token_heads",
        "last_token_raw",
        "lava",
        "token_units",
        "window",
        "window:w=32",
    ]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"unit_size": 0}, r"^block_size \(64\) must be a positive multiple of unit_size \(0\)$"),
        ({"unit_size": 3}, r"^block_size \(64\) must be a positive multiple of unit_size \(3\)$"),
        ({"block_size": 12, "unit_size": 8}, r"^block_size \(12\) must be a positive multiple of unit_size \(8\)$"),
        ({"head_mean": "mean"}, r"^head_mean must be one of all, group, not 'mean'$"),
    ],
)
def test_token_units_refuses_units_that_do_not_tile_a_block_and_unknown_head_means(params, message):
    with pytest.raises(RankkitError, match=message):
        make("token_units", **params)


def test_token_units_takes_units_of_one_token_and_blocks_of_one_unit():
    probe = make("token_units", unit_size=1, block_size=1)
    assert (probe.unit_size, probe.block_size) == (1, 1)
