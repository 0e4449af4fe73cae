"""The test session drops the repository's root from sys.path only where tedebug is importable without it
(tests/support/sys_path.py): else the processes of the distributed tests, which take the parent's sys.path, could
not import tedebug."""

import sys
from importlib.machinery import PathFinder
from pathlib import Path

from support.sys_path import found_without, without_repository_root

ROOT = Path(__file__).resolve().parent.parent


def test_installed_tedebug_drops_the_root():
    path = [str(ROOT)] + [entry for entry in sys.path if entry != str(ROOT)]
    assert without_repository_root(path, ROOT) == path[1:]


def test_a_checkout_on_the_path_keeps_the_root(tmp_path):
    path = [str(ROOT), str(tmp_path)]  # tedebug only under the root
    assert without_repository_root(path, ROOT, finders=[PathFinder]) == path


def test_the_root_goes_where_another_entry_holds_tedebug(tmp_path):
    (tmp_path / "tedebug").mkdir()
    (tmp_path / "tedebug" / "__init__.py").write_text("")
    assert without_repository_root([str(ROOT), str(tmp_path)], ROOT, finders=[PathFinder]) == [str(tmp_path)]


def test_the_current_directory_counts_as_the_root(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert without_repository_root(["", str(tmp_path)], ROOT, finders=[PathFinder]) == ["", str(tmp_path)]
    (tmp_path / "tedebug.py").write_text("")
    assert without_repository_root(["", str(tmp_path)], ROOT, finders=[PathFinder]) == [str(tmp_path)]


def test_a_finder_that_fails_or_lacks_find_spec_is_passed_over(tmp_path):
    class Failing:
        def find_spec(self, name, path):
            raise RuntimeError("cannot answer")

    class Editable:  # an editable install's finder: answers whatever the path
        def find_spec(self, name, path):
            return object() if name == "tedebug" else None

    assert not found_without("tedebug", [str(tmp_path)], [Failing(), object(), PathFinder])
    assert found_without("tedebug", [str(tmp_path)], [Failing(), Editable()])
    assert without_repository_root([str(ROOT)], ROOT, finders=[Failing(), Editable()]) == []
