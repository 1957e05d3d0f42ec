"""Layers run through ggml's backend API (edgeinfer.ggml) inside edgeinfer's engine, on ggml's
CPU backend (the stand-in for CUDA on these machines).

Accuracy: ggml quantizes activations inside its matmuls and rounds Q and the softmax to f16 in
flash attention, so a split model cannot match the all-Numba model bit for bit. The bound is
measured here, as the parity tests do: llama.cpp's own disagreement with the all-Numba model on
the same tokens (prefill then single-token decode steps, so the paged caches are read back). A
split runs only part of the model through ggml, so it must stay within that disagreement.

EDGEINFER_TEST_BACKEND=cuda runs the accuracy, greedy and prefix tests on ggml's CUDA backend
instead (bench/gpu_check.sh); batch invariance is the CPU backend's alone (it refuses others).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from cli_checks import edgeinfer, one_error_line
from llama_oracle import oracle, oracle_logits

from edgeinfer.engine.memory_plan import kv_block_bytes
from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import read_gguf
from edgeinfer.llm import LLM

pytest.importorskip("llama_cpp")

FTYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0",
    "Q4_K_M", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K",
)  # fmt: skip
BACKEND = os.environ.get("EDGEINFER_TEST_BACKEND", "cpu")
N_TOKENS, N_PREFILL = 40, 32
MARGIN = 1.5  # allowed multiple of llama.cpp's own disagreement with the all-Numba model
FLOOR = 1e-6  # NMSE below this is float rounding, whatever the bound
NEAR_TIE = 0.5  # greedy tokens are compared until the all-Numba top-2 gap is this small
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sum((a - ref) ** 2) / np.sum(ref**2))


def tokens(vocab: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(5, vocab, N_TOKENS).tolist()


def run_logits(llm: LLM, toks: list[int]) -> np.ndarray:
    """A prefill then single-token decode steps, as the engine runs a request."""
    e = llm.engine
    out = [e.forward(0, toks[:N_PREFILL])] + [e.forward(0, [t]) for t in toks[N_PREFILL:]]
    e.release(0)
    assert e.blocks.num_used_blocks == 0
    return np.concatenate(out).astype(np.float64)


def spans(n_layers: int) -> list[str]:
    """A split at every layer boundary, both ways round, plus everything on ggml."""
    out = [f"all@{BACKEND}"]
    for k in range(1, n_layers):
        out += [f"{k}-{n_layers - 1}+head@{BACKEND}", f"0-{k - 1}@{BACKEND}"]
    return out


@pytest.fixture(scope="module")
def bounds():
    """(path, tokens) -> (all-Numba logits, llama.cpp's NMSE against them), measured once."""
    cache = {}

    def get(path, toks):
        key = (str(path), tuple(toks))
        if key not in cache:
            ours = run_logits(LLM(str(path), threads=2, ctx=64), toks)
            ref = oracle_logits(oracle(path, 64, n_gpu_layers=0), toks)
            cache[key] = ours, nmse(ref, ours)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_split_at_every_layer_boundary_stays_within_llama_cpps_rounding(
    synthetic_model, bounds, arch
):
    path = synthetic_model(arch, "Q8_0")
    with read_gguf(path) as g:
        cfg = ModelConfig.from_gguf(g)
    toks = tokens(cfg.vocab_size)
    ours, bound = bounds(path, toks)
    for spec in spans(cfg.n_layers):
        split = run_logits(LLM(str(path), threads=2, ctx=64, offload=spec), toks)
        err = nmse(split, ours)
        print(f"{arch} {spec}: NMSE {err:.2e} (llama.cpp: {bound:.2e})")
        assert err <= max(MARGIN * bound, FLOOR), (spec, err, bound)


@pytest.mark.parametrize("ftype", FTYPES)
def test_every_weight_type_runs_through_the_executor(synthetic_model, bounds, ftype):
    """All layers and the head on ggml, weights uploaded as the file stores them."""
    path = synthetic_model("llama", ftype)
    toks = tokens(300)
    ours, bound = bounds(path, toks)
    got = run_logits(LLM(str(path), threads=2, ctx=64, offload=f"all@{BACKEND}"), toks)
    assert nmse(got, ours) <= max(MARGIN * bound, FLOOR), (ftype, nmse(got, ours), bound)


def greedy_agree(path: str, spec: str, prompt: list[int], steps: int = 24) -> int:
    """Greedy decoding of the split model follows the all-Numba model's tokens until the
    all-Numba model's top-2 gap is a near-tie -> how many tokens were compared."""
    a = LLM(path, threads=2, ctx=64).engine
    b = LLM(path, threads=2, ctx=64, offload=spec).engine
    la, lb = a.forward(0, prompt)[-1], b.forward(0, prompt)[-1]
    for compared in range(steps):
        top2 = np.sort(la)[-2:]
        if top2[1] - top2[0] < NEAR_TIE:
            return compared
        want = int(la.argmax())
        assert int(lb.argmax()) == want, f"{spec}: greedy token {compared} differs"
        la, lb = a.forward(0, [want])[-1], b.forward(0, [want])[-1]
    return steps


def test_greedy_continuations_agree(synthetic_model):
    compared = 0
    for arch, spec in (("qwen3", f"1+head@{BACKEND}"), ("gemma3", f"0-2@{BACKEND}")):
        path = str(synthetic_model(arch, "Q8_0"))
        compared += greedy_agree(path, spec, [5, 17, 42, 99, 7, 3, 250, 64])
    assert compared >= 8


@pytest.fixture(scope="module")
def llama_f32(synthetic_model):
    return synthetic_model("llama", "F32")


def prompts(vocab: int, lengths, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 40).tolist()
    return [shared + rng.integers(0, vocab, n).tolist() if i % 2 else
            rng.integers(0, vocab, n).tolist() for i, n in enumerate(lengths)]  # fmt: skip


def test_batch_invariant_split_gives_each_request_its_tokens_alone(llama_f32):
    """batch_invariant's promise holds for a split model too: ggml's CPU backend then runs its
    reference kernels (no tiling or KV splits that depend on the batch)."""
    kw = dict(threads=2, offload="1+head@cpu", batch_invariant=True)
    llm = LLM(str(llama_f32), max_num_batched_tokens=64, **kw)
    batch = prompts(llm.config.vocab_size, [3, 50, 9, 70, 1, 33])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = llm.generate(batch, params)
    solo = LLM(str(llama_f32), prefix_caching=False, **kw)
    for p, c in zip(batch, got, strict=True):
        alone = solo.generate(p, params)[0]
        assert c.token_ids == alone.token_ids
        assert [lp.logprob for lp in c.logprobs] == [lp.logprob for lp in alone.logprobs]
    assert llm.stats().prefix_cache_hit_tokens > 0
    assert llm.kv_usage()[0] == 0


def test_prefix_cache_reuse_across_turns_with_offloaded_layers(llama_f32):
    llm = LLM(str(llama_f32), threads=2, offload=f"1+head@{BACKEND}")
    turn1 = list(range(5, 60))
    first = llm.generate(turn1, GREEDY)[0]
    turn2 = turn1 + first.token_ids + list(range(100, 120))
    second = llm.generate(turn2, GREEDY)[0]
    assert llm.stats().prefix_cache_hit_tokens >= 48  # the first turn's full blocks
    fresh = LLM(str(llama_f32), threads=2, offload=f"1+head@{BACKEND}", prefix_caching=False)
    assert second.token_ids == fresh.generate(turn2, GREEDY)[0].token_ids
    assert llm.kv_usage()[0] == 0


def test_preemption_and_abort_free_device_blocks_and_reuse_them_correctly(llama_f32):
    with read_gguf(llama_f32) as g:
        block = kv_block_bytes(ModelConfig.from_gguf(g), "f16")
    kw = dict(threads=2, offload="1@cpu", batch_invariant=True)
    llm = LLM(str(llama_f32), kv_budget=6 * block, **kw)  # 96 tokens for 4 requests of 40
    batch = prompts(llm.config.vocab_size, [20, 20, 20, 20], seed=1)[::2] * 2
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = [c.token_ids for c in llm.generate(batch, params)]
    assert llm.stats().preemptions > 0
    solo = LLM(str(llama_f32), prefix_caching=False, **kw)
    assert got == [solo.generate(p, params)[0].token_ids for p in batch]
    assert llm.kv_usage()[0] == 0
    stream = llm.stream(batch[0], params)
    next(stream)
    stream.close()  # abort mid-decode
    assert llm.kv_usage()[0] == 0
    assert llm.generate(batch[0], params)[0].token_ids == got[0]


@pytest.mark.parametrize(
    "knobs, needle",
    [
        (dict(offload="2@cpu"), "layer 2 is out of range"),
        (dict(offload="0-1@tpu"), "unknown ggml backend"),
        (dict(offload="1-0@cpu"), "empty"),
        (dict(offload="0+head@cpu"), "+head needs the span to end at the last layer"),
        (dict(offload="0@cuda"), "make cuda"),
        (dict(gpu_layers=1), "make cuda"),
        (dict(offload="all@cpu", gpu_layers=2), "not both"),
        (dict(offload="all@cpu", parallel=10**7), "free; offload fewer layers"),
    ],
)
def test_a_bad_split_is_one_clear_error(llama_f32, knobs, needle):
    with pytest.raises(EdgeInferError, match=needle.replace("+", r"\+")):
        LLM(str(llama_f32), threads=2, **knobs)


def test_an_abi_mismatch_is_refused(monkeypatch):
    from edgeinfer.ggml import lib

    monkeypatch.setattr(lib, "GGML_VERSION", "0.0.1")
    with pytest.raises(lib.GGMLError, match="expected 0.0.1"):
        lib.check_abi(lib.load())
    monkeypatch.setattr(lib, "GGML_OBJECT_SIZE", 40)
    with pytest.raises(lib.GGMLError, match="ggml_tensor_overhead"):
        lib.check_abi(lib.load())


def test_cli_bad_split_is_one_line_and_exit_2(llama_f32):
    r = edgeinfer("run", str(llama_f32), "-p", "hello", "-n", "2", "--offload", "5-9@cpu")
    one_error_line(r, "out of range")
    r = edgeinfer("run", str(llama_f32), "-p", "hello", "-n", "2", "--gpu-layers", "2")
    one_error_line(r, "make cuda")


def test_info_plans_host_and_device_memory_separately(llama_f32):
    import json

    r = edgeinfer("info", str(llama_f32), "--json", "--ctx", "64", "--offload", "1+head@cpu")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    whole = json.loads(edgeinfer("info", str(llama_f32), "--json", "--ctx", "64").stdout)
    host, dev = data["memory"], data["device"]
    # the host keeps layer 0's KV only; the device holds layer 1's, in rows of the same slots
    assert host["kv_bytes"] * 2 == whole["memory"]["kv_bytes"]
    rows = 256  # 1 scratch row + 4 blocks x 16 slots, in steps of 256 rows
    assert dev["kv_bytes"] == rows * 2 * 2 * 64 * 2  # rows x (K + V) x kv_heads x head_dim x f16
    assert dev["weights_bytes"] == 0 and dev["host_memory"] and dev["fits"]
    assert dev["span"] == "layer 1 + head on ggml cpu"
    one_error_line(edgeinfer("info", str(llama_f32), "--gpu-layers", "1"), "make cuda")


def test_the_chat_stats_say_which_layers_run_where(llama_f32):
    from test_tui import SHORT, notices, run, send

    from edgeinfer.tui import session as sessions
    from edgeinfer.tui.app import ChatApp, ChatOptions

    llm = LLM(str(llama_f32), ctx=64, offload="1+head@cpu")
    assert llm.placement().startswith("layer 1 + head on ggml cpu: CPU")
    assert llm.placement().endswith("; layer 0 on edgeinfer's kernels")
    info = sessions.describe(llm, llama_f32)
    app = ChatApp(ChatOptions(model=str(llama_f32), params=SHORT), loaded=(llm, info))

    async def script(pilot):
        await send(pilot, "/stats")
        await pilot.pause()
        line = notices(app)[-1]
        assert "layer 1 + head on ggml cpu" in line and "KV cache 256.0 KiB" in line

    run(app, (160, 30), script)


def test_an_f32_kv_cache_on_the_device(llama_f32):
    """kv_dtype f32: the span's cache is float32 on the backend too (F32 weights: the two paths
    differ only by float rounding)."""
    toks = list(range(5, 45))
    ours = run_logits(LLM(str(llama_f32), threads=2, ctx=64, kv_dtype="f32"), toks)
    llm = LLM(str(llama_f32), threads=2, ctx=64, kv_dtype="f32", offload=f"all@{BACKEND}")
    # 2 layers x 512 rows (a scratch row + 4 x 64 slots, in steps of 256) x (K + V) 256 x 4 B
    assert "KV cache 1.0 MiB" in llm.placement()
    assert nmse(run_logits(llm, toks), ours) < FLOOR
