"""Chart test fixtures: one helm runner per session and the two standard renders."""

import pytest

from .chart import ALL_ON_VALUES, Helm, tool_path, tools_env


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    home = tmp_path_factory.mktemp("helm-home")
    return Helm(tool_path("helm"), tools_env(home))


@pytest.fixture(scope="session")
def default_docs(helm) -> tuple[dict, ...]:
    return helm.template()


@pytest.fixture(scope="session")
def all_on_docs(helm) -> tuple[dict, ...]:
    return helm.template(ALL_ON_VALUES)
