"""The runtime's knobs are checked once, in EngineConfig, before anything loads."""

import pytest

from edgeinfer.config import PREFILL_CHUNK, ConfigError, EngineConfig
from edgeinfer.errors import EdgeInferError


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"threads": 0}, "threads"),
        ({"ctx": 0}, "ctx"),
        ({"parallel": 0}, "--parallel"),
        ({"parallel": 1.5}, "parallel"),
        ({"kv_budget": 0}, "kv_budget"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": PREFILL_CHUNK + 1}, f"at most {PREFILL_CHUNK}"),
        ({"max_wait_ms": -1}, "max_wait_ms"),
        ({"kv_dtype": "q4"}, "kv dtype must be one of f16, f32"),
        ({"prefix_caching": 1}, "prefix_caching"),
        ({"batch_invariant": "yes"}, "batch_invariant"),
    ],
)
def test_a_knob_out_of_range_is_refused_with_its_name(knobs, message):
    with pytest.raises(ConfigError, match=message) as e:
        EngineConfig(**knobs)
    assert isinstance(e.value, EdgeInferError)


def test_defaults_and_the_logit_rows_a_step_plans_for():
    config = EngineConfig()
    assert config.max_num_batched_tokens == PREFILL_CHUNK and config.kv_dtype == "f16"
    assert EngineConfig(max_num_seqs=8, max_num_batched_tokens=64).step_logit_rows == 8
    assert EngineConfig(max_num_seqs=64, max_num_batched_tokens=16).step_logit_rows == 16
