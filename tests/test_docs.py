"""The generated docs stay in step with the code: docs/errors.md is the validation cases' output."""

from tools import error_table


def test_error_table_is_up_to_date():
    assert error_table.DOC.read_text() == error_table.render(), (
        "docs/errors.md is out of date: run python -m tools.error_table")
    assert error_table.render().count("\n| `") >= 50
