"""A change to any kernel source's code drops the cached kernels, not only a change to the file
that defines them (Numba's own check); a change to its comments or docstrings does not."""

import os

import pytest

from edgeinfer.kernels import cache_stamp
from edgeinfer.kernels.cache_stamp import STAMP, refresh, remembered


def cached_files(cache):
    return sorted(p.name for p in cache.iterdir() if p.suffix in (".nbi", ".nbc"))


def test_a_change_to_any_source_drops_the_cached_kernels(tmp_path):
    (tmp_path / "unit.py").write_text("from .shared import helper\n")
    (tmp_path / "shared.py").write_text("def helper(): return 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def fill():
        for name in ("unit.kernel-3.py311.nbi", "unit.kernel-3.py311.1.nbc"):
            (cache / name).write_bytes(b"compiled")

    fill()
    assert refresh(tmp_path)  # never recorded: what is cached has no known sources
    assert cached_files(cache) == [] and (cache / STAMP).exists()

    fill()
    assert not refresh(tmp_path)  # same sources: the cache stays
    assert len(cached_files(cache)) == 2

    (tmp_path / "shared.py").write_text("def helper(): return 2\n")  # only the inlined file
    assert refresh(tmp_path)
    assert cached_files(cache) == []
    assert not refresh(tmp_path)


def test_comments_and_docstrings_are_not_part_of_the_key(tmp_path):
    shared = tmp_path / "shared.py"
    shared.write_text('"""Helpers."""\n\n\ndef helper():\n    return 1  # one\n')
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    (cache / "unit.kernel-3.py311.nbi").write_bytes(b"compiled")
    assert refresh(tmp_path)
    (cache / "unit.kernel-3.py311.nbi").write_bytes(b"compiled")

    shared.write_text(
        '"""Helpers, reworded."""\n\n\ndef helper():\n    """Returns one."""\n'
        "    # the first number\n    return 1  # 1\n"
    )
    assert not refresh(tmp_path)
    assert cached_files(cache) == ["unit.kernel-3.py311.nbi"]
    assert not refresh(tmp_path)

    shared.write_text('"""Helpers."""\n\n\ndef helper():\n    return "1"  # one\n')
    assert refresh(tmp_path)
    assert cached_files(cache) == []


def test_unchanged_files_are_not_parsed(tmp_path, monkeypatch):
    source = tmp_path / "unit.py"
    source.write_text("x = 1\n")
    os.utime(source, ns=(10**18, 10**18))  # older than the stamp written next
    assert refresh(tmp_path)

    def no_parse(source):
        raise AssertionError("parsed a file whose size and timestamp are as recorded")

    monkeypatch.setattr(cache_stamp, "code_of", no_parse)
    assert not refresh(tmp_path)
    source.write_text("x = 2\n")
    with pytest.raises(AssertionError, match="parsed"):
        refresh(tmp_path)


def test_a_cache_it_cannot_write_is_left_alone(tmp_path):
    (tmp_path / "unit.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").write_text("not a directory")  # cannot hold a stamp
    assert not refresh(tmp_path)


def test_an_answer_is_kept_while_its_key_and_the_code_stay_the_same(tmp_path):
    (tmp_path / "unit.py").write_text("def helper(): return 1\n")
    refresh(tmp_path)
    asked = []

    def ask(answer):
        def asking():
            asked.append(answer)
            return answer

        return asking

    assert remembered(tmp_path, "probe", "cpu a", ask(True)) is True
    assert remembered(tmp_path, "probe", "cpu a", ask(False)) is True  # kept: not asked
    assert asked == [True]
    assert remembered(tmp_path, "probe", "cpu b", ask(False)) is False  # another target
    assert remembered(tmp_path, "probe", "cpu b", ask(True)) is False
    assert asked == [True, False]

    (tmp_path / "unit.py").write_text("def helper(): return 2\n")
    assert refresh(tmp_path)  # the code changed: the answer goes with the kernels
    assert remembered(tmp_path, "probe", "cpu b", ask(True)) is True
    assert asked == [True, False, True]

    (tmp_path / "__pycache__" / "probe.answer").write_text("cpu b\nmaybe")  # damaged
    assert remembered(tmp_path, "probe", "cpu b", ask(False)) is False
    assert asked == [True, False, True, False]


def test_an_answer_without_a_writable_cache_is_asked_each_time(tmp_path):
    asked = []
    for _ in range(2):  # no __pycache__ to keep it in
        assert remembered(tmp_path, "probe", "cpu a", lambda: asked.append(1) or True)
    assert asked == [1, 1] and list(tmp_path.iterdir()) == []
