"""Output-guard pin found by mutation (s37): a folder of yours is refused as not
quantscope's, whether or not overwrite is passed."""

import pytest

from quantscope.exporters.atomic import check_writable_target


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_users_folder_is_refused_as_not_quantscopes(tmp_path, overwrite):
    """A non-empty folder quantscope did not write is refused as not replaceable even
    without overwrite: the error does not offer overwrite=True, which would be refused too."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a folder quantscope wrote") as e:
        check_writable_target(str(mine), overwrite=overwrite)
    assert "pass overwrite=True" not in str(e.value)
    assert (mine / "notes.txt").read_text() == "x"
