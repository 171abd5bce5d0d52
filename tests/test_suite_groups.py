"""`make test` runs each test file whole on one pytest-xdist worker (tests/conftest.py makes each file a group;
``--dist loadgroup`` keeps a group together), so an msrun file's module fixture launches once, not once per worker."""
import pytest


def test_this_test_carries_its_files_group_into_the_id_xdist_schedules_by(request):
    assert request.node.get_closest_marker("xdist_group").args == ("test_suite_groups.py",)
    # under --dist loadgroup (each worker's option) pytest-xdist appends the group to the id its scheduler reads;
    # where it cannot (pytest 9.2 with pytest-xdist 3.8: pyproject.toml), the file's tests spread over the workers
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@test_suite_groups.py"), request.node.nodeid


def test_the_longest_groups_of_one_test_are_collected_first_in_their_order(request):
    """conftest.LONGEST_ONE_TEST_GROUPS names groups of one test (a renamed file or benchmark would silently drop out
    of the order), and the collection starts with them, so xdist hands them out first among such groups."""
    from conftest import LONGEST_ONE_TEST_GROUPS

    items = request.session.items
    if {item.path for item in items} != set(request.config.rootpath.glob("tests/**/test_*.py")):
        pytest.skip("the order of the whole suite: this run collected part of it")
    groups = [item.get_closest_marker("xdist_group").args[0] for item in items]
    assert all(groups.count(group) == 1 for group in LONGEST_ONE_TEST_GROUPS), LONGEST_ONE_TEST_GROUPS
    assert groups[:len(LONGEST_ONE_TEST_GROUPS)] == list(LONGEST_ONE_TEST_GROUPS)
