"""`settings.Settings`: the operator's one settings object, read once from its environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disagg.operator.naming import Installation
from disagg.operator.settings import Settings, SettingsError


def test_an_empty_environment_gives_the_defaults() -> None:
    assert Settings.from_environ({}) == Settings()
    assert Settings().installation == Installation()
    assert (Settings().log_level, Settings().planner_interval_s) == ("info", 5.0)


def test_every_variable_lands_in_its_field_and_an_empty_one_is_unset() -> None:
    read = Settings.from_environ(
        {
            "DISAGG_WORKER_IMAGE": "r/disagg:1",
            "DISAGG_TRANSFER_IMAGE": "r/disagg-transfer:1",
            "DISAGG_ROUTER_IMAGE": "",
            "DISAGG_WORKER_CLUSTERROLE": "ops-worker",
            "DISAGG_LOG_LEVEL": "debug",
            "DISAGG_PLANNER_INTERVAL_S": "1.5",
        }
    )
    assert read.installation == Installation(
        worker_cluster_role="ops-worker", worker_image="r/disagg:1", transfer_image="r/disagg-transfer:1"
    )
    assert (read.log_level, read.planner_interval_s) == ("debug", 1.5)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DISAGG_PLANNER_INTERVAL_S", "soon"),
        ("DISAGG_PLANNER_INTERVAL_S", "0"),
        ("DISAGG_PLANNER_INTERVAL_S", "nan"),
        ("DISAGG_LOG_LEVEL", "verbose"),
    ],
)
def test_a_value_the_operator_cannot_read_is_refused_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"{variable} is {value!r}"):
        Settings.from_environ({variable: value})


def test_the_operator_command_refuses_an_unreadable_setting_before_it_starts() -> None:
    env = {"DISAGG_PLANNER_INTERVAL_S": "soon", "PYTHONSAFEPATH": "1", "KUBECONFIG": "/nonexistent"}
    run = subprocess.run(
        [sys.executable, "-m", "disagg.operator.cli.main", "operator", "run", "--namespace", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "disagg operator run: DISAGG_PLANNER_INTERVAL_S is 'soon': set it to a number of seconds above 0"
    )
