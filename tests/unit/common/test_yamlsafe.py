"""Bounded YAML: hostile documents are refused naming the limit; ordinary ones load as
``yaml.safe_load`` loads them."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from hpd_common.yamlsafe import YamlLimitError, load_bounded

HOSTILE = [
    pytest.param("[" * 5000 + "]" * 5000, "levels", id="deep-flow-sequence"),
    pytest.param("{a: " * 3000 + "1" + "}" * 3000, "levels", id="deep-flow-mapping"),
    pytest.param("x: " + "[" * 200_000, "levels", id="unclosed-brackets"),
    pytest.param("- " * 3000 + "x", "levels", id="chained-block-sequence"),
    pytest.param(
        "a:\n" + "".join("  " * i + "b:\n" for i in range(1, 300)), "columns", id="deep-block"
    ),
    pytest.param("a: don't\nb: " + "[" * 3000, "levels", id="apostrophe-does-not-hide"),
    pytest.param("a: &x [1]\nb: [" + ", ".join(["*x"] * 500) + "]", "aliases", id="alias-fan-out"),
]


@pytest.mark.parametrize(("text", "limit"), HOSTILE)
def test_a_hostile_document_is_refused_naming_the_limit(text: str, limit: str) -> None:
    with pytest.raises(YamlLimitError) as err:
        load_bounded(text)
    assert limit in str(err.value)


def test_a_document_with_too_many_nodes_is_refused() -> None:
    assert len(load_bounded("[" + "1, " * 998 + "1]", max_nodes=1000)) == 999
    with pytest.raises(YamlLimitError) as err:
        load_bounded("[" + "1, " * 1000 + "1]", max_nodes=1000)
    assert "1000 nodes" in str(err.value)


def test_the_limit_is_exact_for_flow_nesting() -> None:
    assert load_bounded("[" * 64 + "]" * 64) is not None
    with pytest.raises(YamlLimitError):
        load_bounded("[" * 65 + "]" * 65)


@pytest.mark.parametrize(
    "text",
    [
        'x: \'[[[[[\'\ny: "[[[\\"[["\n# [[[[[ {{{{\nz: [1, [2, [3]]]\n',
        "a: don't\nb: 'it''s [x'\nc: [1]\n",
        "list:\n- a\n- - b\n  - c\nmap: {k: v}\n",
    ],
)
def test_ordinary_documents_load_as_safe_load_loads_them(text: str) -> None:
    assert load_bounded(text) == yaml.safe_load(text)


def test_every_shipped_profile_loads_unchanged() -> None:
    root = resources.files("hpd_scheduler.policy") / "profiles"
    names = [e.name for e in root.iterdir() if e.name.endswith(".yaml")]
    assert names
    for name in names:
        text = (root / name).read_text()
        assert load_bounded(text) == yaml.safe_load(text), name


def test_not_yaml_is_a_yaml_error() -> None:
    with pytest.raises(yaml.YAMLError):
        load_bounded("a: [1, 2\nb: }")
