"""One tiny random model and engine per test module of tests/rollout."""

import pytest

from flowloop.rollout import RolloutEngine
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return make_tiny_model()


@pytest.fixture(scope="module")
def engine(model):
    return RolloutEngine(model)
