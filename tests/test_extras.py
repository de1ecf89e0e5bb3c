import pytest

from flowloop.extras import require


def test_missing_optional_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # make the import fail for real
    with pytest.raises(ImportError, match=r"pip install 'flowloop\[wandb\]'"):
        require("wandb", "wandb logging")


def test_present_package_is_returned():
    assert require("json", "anything").dumps([1]) == "[1]"
