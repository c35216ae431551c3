"""A mesh as a recipe writes it, read into devices and written back the same way."""

import pytest

from areal_flow.graph.mesh import format_mesh, parse_mesh


@pytest.mark.parametrize("spec, devices", [
    ("0", (0,)), (3, (3,)), ("0-3", (0, 1, 2, 3)), (" 2,0 ", (0, 2)), ("4-5,0-1", (0, 1, 4, 5)), ("1,1", (1,)),
])
def test_a_device_list_reads_as_sorted_devices(spec, devices):
    assert parse_mesh(spec, "graph.x.mesh") == (devices, None)


@pytest.mark.parametrize("spec", ["", "a", "3-1", "-1", "0,,1"])
def test_anything_else_is_a_problem_naming_the_key(spec):
    assert parse_mesh(spec, "node 'x' (graph.x.mesh)") == (
        None, f"node 'x' (graph.x.mesh): mesh {spec.strip()!r} is not a device list like '0', '0-3' or '0,2'")


def test_runs_of_three_or_more_print_as_a_range_and_read_back():
    assert [format_mesh(m) for m in ((), None, (0,), (0, 1), (0, 1, 2), (0, 1, 2, 3, 4, 5, 6, 7, 9, 10))] == \
        ["-", "-", "0", "0,1", "0-2", "0-7,9,10"]
    assert parse_mesh(format_mesh((0, 1, 2, 5, 7, 8, 9)), "k") == ((0, 1, 2, 5, 7, 8, 9), None)
