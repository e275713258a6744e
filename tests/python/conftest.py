"""pytest options for the Python package's tests: --carry-binary, the `carry` program whose `carry mixer`
output the package is compared with (the test that needs it is skipped without it)."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--carry-binary", default=None, help="path of the carry program (build/bin/carry)")


@pytest.fixture
def carry_binary(request):
    path = request.config.getoption("--carry-binary")
    if not path:
        pytest.skip("no --carry-binary given")
    return path
