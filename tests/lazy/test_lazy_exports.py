"""A package's names imported on first use (lowcomm/lazy/exports.py), on a package made for the test:
a name is imported only when asked for, once, under its own name or another; an unknown name is
an AttributeError naming the package; dir() lists the names before any is imported."""
from __future__ import annotations

import sys
import textwrap

import pytest

import lowcomm
import lowcomm.config
import lowcomm.data


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    pkg = tmp_path / "lazyfake"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from lowcomm.lazy.exports import lazy_exports
        __getattr__, __dir__ = lazy_exports(__name__, {"VALUE": ".heavy", "renamed": (".heavy", "original")},
                                            globals(), submodules=True)
    """))
    (pkg / "heavy.py").write_text("IMPORTS = []\nIMPORTS.append(1)\nVALUE = 42\ndef original():\n    return 'o'\n")
    (pkg / "sub" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m == "lazyfake" or m.startswith("lazyfake.")]:
        del sys.modules[name]


def test_a_name_is_imported_when_first_asked_and_kept(fake_package):
    import lazyfake
    assert "lazyfake.heavy" not in sys.modules
    assert {"VALUE", "renamed"} <= set(dir(lazyfake))
    assert lazyfake.VALUE == 42 and "lazyfake.heavy" in sys.modules
    assert lazyfake.renamed() == "o"
    assert vars(lazyfake)["VALUE"] == 42  # kept: the next access does not import again
    assert sys.modules["lazyfake.heavy"].IMPORTS == [1]
    assert lazyfake.sub is sys.modules["lazyfake.sub"]  # a submodule, not imported first
    with pytest.raises(AttributeError, match="module 'lazyfake' has no attribute 'nothing'"):
        lazyfake.nothing


def test_lowcomm_config_and_data_export_what_they_list():
    """Every name each of the three packages lists resolves (a wrong module in a table fails here)."""
    for package in (lowcomm, lowcomm.config, lowcomm.data):
        for name in package.__all__:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"
    assert lowcomm.make_strategy is lowcomm.make_run and lowcomm.config.UsageError is lowcomm.UsageError
    with pytest.raises(AttributeError, match="module 'lowcomm.data' has no attribute 'nope'"):
        lowcomm.data.nope
