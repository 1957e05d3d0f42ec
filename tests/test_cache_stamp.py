"""A change to any kernel source drops the cached kernels, not only a change to the file that
defines them (Numba's own check)."""

from edgeinfer.kernels.cache_stamp import STAMP, refresh


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


def test_a_cache_it_cannot_write_is_left_alone(tmp_path):
    (tmp_path / "unit.py").write_text("x = 1\n")
    (tmp_path / "__pycache__").write_text("not a directory")  # cannot hold a stamp
    assert not refresh(tmp_path)
