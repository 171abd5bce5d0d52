"""The sources config (configs/sources.yaml): every bad field refused naming `<file>: sources.<name>.<field>`."""
import pytest

from assets.sources import SourcesConfigError, load_sources


def write_sources(tmp_path, weight_entry: str):
    path = tmp_path / "sources.yaml"
    path.write_text("sources:\n"
                    "  code: {builtin: python_stdlib_code, max_bytes: 1000, weight: 0.6}\n"
                    f"  docs: {{builtin: python_stdlib_docstrings, max_bytes: 1000{weight_entry}}}\n")
    return path


@pytest.mark.parametrize("weight", ["0", "0.0", "-0.5", ".nan", ".inf", "true", "'1'"])
def test_a_weight_that_is_not_a_positive_number_is_refused_where_it_is_written(tmp_path, weight):
    path = write_sources(tmp_path, f", weight: {weight}")
    with pytest.raises(SourcesConfigError, match=rf"^{path}: sources\.docs\.weight must be a number > 0, got .*"
                                                 rf"to leave a source out, remove it from sources\.yaml"):
        load_sources(path)


def test_weights_as_written_and_one_by_default(tmp_path):
    assert {name: spec.weight for name, spec in load_sources(write_sources(tmp_path, "")).items()} == {
        "code": 0.6, "docs": 1.0}
    assert load_sources(write_sources(tmp_path, ", weight: 2"))["docs"].weight == 2.0


def test_a_missing_sources_file_is_named(tmp_path):
    with pytest.raises(SourcesConfigError, match=rf"^{tmp_path / 'absent.yaml'}: unreadable sources config"):
        load_sources(tmp_path / "absent.yaml")
