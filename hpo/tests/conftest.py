import pytest


@pytest.fixture(autouse=True)
def _judge_trials_at_once(settings):
    # The tests store a trial's metrics before ending its job: nothing is still on its way.
    settings.EDT_HPO_SETTLE_S = 0
