"""The agent-loop registry: decorator, YAML entries instantiated with Hydra, clear errors."""

from __future__ import annotations

import pytest

from flowloop.agent_loop import (
    SingleTurnAgentLoop,
    agent_loop_config,
    instantiate_agent_loop,
    load_agent_loop_configs,
    register_agent_loop,
    registered_agent_loops,
)
from tests.agent_loop.helpers import EXAMPLE_YAML


def test_single_turn_is_registered_by_its_decorator():
    assert agent_loop_config("single_turn") == {"_target_": "flowloop.agent_loop.single_turn.SingleTurnAgentLoop"}
    loop = instantiate_agent_loop("single_turn", client="a client", tokenizer="a tokenizer")
    assert isinstance(loop, SingleTurnAgentLoop) and loop.client == "a client"


def test_shipped_example_yaml_loads_and_builds_with_its_kwargs():
    assert load_agent_loop_configs(EXAMPLE_YAML) == ["retry_until_correct"]
    assert load_agent_loop_configs(EXAMPLE_YAML) == ["retry_until_correct"]  # loading twice is harmless
    loop = instantiate_agent_loop("retry_until_correct", client=None, tokenizer=None)
    assert type(loop).__name__ == "RetryUntilCorrectAgentLoop" and loop.max_attempts == 3


def test_unknown_name_lists_registered_loops():
    with pytest.raises(ValueError, match=r"unknown agent loop 'nope'; registered agent loops: \[.*'single_turn'.*\]"):
        agent_loop_config("nope")


def test_a_name_cannot_be_taken_twice(tmp_path):
    clash = tmp_path / "clash.yaml"
    clash.write_text("- name: single_turn\n  _target_: somewhere.Else\n")
    with pytest.raises(ValueError, match=r"agent loop 'single_turn' from .*clash.yaml is already registered"):
        load_agent_loop_configs(clash)
    assert agent_loop_config("single_turn")["_target_"].endswith("SingleTurnAgentLoop")

    @register_agent_loop("test_only_loop")
    class Mine:
        def __init__(self, client, tokenizer):
            pass

    assert "test_only_loop" in registered_agent_loops()
    with pytest.raises(ValueError, match="already registered"):
        register_agent_loop("test_only_loop")(SingleTurnAgentLoop)


@pytest.mark.parametrize(
    "text, error",
    [
        ("name: x\n_target_: y\n", "must hold a YAML list"),
        ("- name: x\n", r"entry 0 needs 'name' and '_target_'"),
    ],
)
def test_malformed_yaml_is_explained(tmp_path, text, error):
    path = tmp_path / "loops.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_agent_loop_configs(path)
    with pytest.raises(FileNotFoundError, match="agent_loop_config_path"):
        load_agent_loop_configs(tmp_path / "missing.yaml")


class _Counted:
    """A loop whose every construction is counted (instances are per row, never shared)."""

    built = 0

    def __init__(self, client, tokenizer, depth: int = 1, helper=None):
        type(self).built += 1
        self.client, self.tokenizer, self.depth, self.helper = client, tokenizer, depth, helper


class _Helper:
    def __init__(self, size: int):
        self.size = size


def test_each_row_gets_a_new_loop_with_its_yaml_kwargs(tmp_path):
    path = tmp_path / "loops.yaml"
    path.write_text(f"- name: counted_plain\n  _target_: {__name__}._Counted\n  depth: 4\n"
                    f"- name: counted_nested\n  _target_: {__name__}._Counted\n"
                    f"  helper: {{_target_: {__name__}._Helper, size: 2}}\n")
    load_agent_loop_configs(path)
    before = _Counted.built
    first = instantiate_agent_loop("counted_plain", client="c1", tokenizer="t")
    second = instantiate_agent_loop("counted_plain", client="c2", tokenizer="t")
    assert _Counted.built == before + 2 and first is not second
    assert (first.client, second.client, first.depth, second.depth) == ("c1", "c2", 4, 4)
    # A nested object is built for each row too, not shared between rows.
    a = instantiate_agent_loop("counted_nested", client=None, tokenizer=None)
    b = instantiate_agent_loop("counted_nested", client=None, tokenizer=None)
    assert isinstance(a.helper, _Helper) and a.helper.size == 2 and a.helper is not b.helper
