"""Start-up steps run with the cyclic collector off and freeze what they made, once per step;
a step that raises freezes nothing, and a collector someone else turned off stays off."""

import gc

import pytest

from edgeinfer.gc_pause import start_up


@pytest.fixture(autouse=True)
def _collector_on():
    gc.enable()
    yield
    gc.enable()
    gc.unfreeze()


def test_a_steps_first_run_pauses_the_collector_and_freezes_what_it_made():
    gc.unfreeze()
    with start_up("test: first run"):
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    assert frozen >= len(made)

    with start_up("test: first run"):  # done once: the collector runs as usual
        assert gc.isenabled()
        more = [[i] for i in range(1000)]
    assert gc.get_freeze_count() == frozen and len(more) == 1000


def test_a_step_that_raises_freezes_nothing_and_runs_paused_again():
    gc.unfreeze()
    with pytest.raises(ValueError), start_up("test: raises"):
        raise ValueError("a bad model file")
    assert gc.isenabled() and gc.get_freeze_count() == 0

    with start_up("test: raises"):
        assert not gc.isenabled()
    assert gc.get_freeze_count() > 0


def test_a_collector_turned_off_elsewhere_is_left_off():
    gc.unfreeze()
    gc.disable()
    with start_up("test: already off"):
        assert not gc.isenabled()
    assert not gc.isenabled() and gc.get_freeze_count() == 0
