"""service/process/supervisor.py's open-files limit: raised to what the unit asks, or warned of."""

import resource

import pytest

from service.process.processes import raise_open_files_limit

pytestmark = pytest.mark.serial


def test_an_open_files_limit_below_what_the_unit_asks_is_raised_or_warned_of(caplog):
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with caplog.at_level("WARNING", logger="corechat.supervisor"):
        raise_open_files_limit(hard)
    assert not caplog.records
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    with caplog.at_level("WARNING", logger="corechat.supervisor"):
        raise_open_files_limit(hard + 1)
    assert f"the open-files limit is {hard}, below the {hard + 1} the unit asks for" in caplog.text
