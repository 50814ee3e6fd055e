"""A directory put in place whole (lowcomm/storage/files.py's replace_directory): a new one is
renamed into place; an older one is replaced, not merged, and nothing is left beside it."""
from __future__ import annotations

from lowcomm.storage.files import replace_directory


def test_a_directory_is_put_in_place_and_an_older_one_replaced_whole(tmp_path):
    target = tmp_path / "model"
    first = tmp_path / ".model.tmp-1"
    first.mkdir()
    (first / "a.txt").write_text("first")
    replace_directory(first, target)
    assert (target / "a.txt").read_text() == "first" and not first.exists()
    second = tmp_path / ".model.tmp-2"
    second.mkdir()
    (second / "b.txt").write_text("second")
    replace_directory(second, target)
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]  # the older files went with their directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing moved aside is left
