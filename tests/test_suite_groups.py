"""`make test` runs each test file whole on one pytest-xdist worker (tests/conftest.py makes each file a group;
``--dist loadgroup`` keeps a group together), so an msrun file's module fixture launches once, not once per worker."""


def test_this_test_carries_its_files_group_into_the_id_xdist_schedules_by(request):
    assert request.node.get_closest_marker("xdist_group").args == ("test_suite_groups.py",)
    # under --dist loadgroup (each worker's option) pytest-xdist appends the group to the id its scheduler reads;
    # where it cannot (pytest 9.2 with pytest-xdist 3.8: pyproject.toml), the file's tests spread over the workers
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@test_suite_groups.py"), request.node.nodeid
