"""`edgeinfer info MODEL`: what is in a GGUF file, and the memory it needs before it runs."""

from __future__ import annotations

import json
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from edgeinfer.cli.options import GpuLayers, Offload, Rpc, Spec
from edgeinfer.config import EngineConfig
from edgeinfer.engine import memory_plan
from edgeinfer.engine.kv_cache import KV_DTYPES
from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf.hub import MODELS, resolve_model
from edgeinfer.gguf.model_config import ModelConfig
from edgeinfer.gguf.reader import GGUFFile, read_gguf
from edgeinfer.units import human_bytes, human_count

# typer's choices for --kv-dtype
KVDtype = Enum("KVDtype", {name: name for name in KV_DTYPES}, type=str)


def type_histogram(g: GGUFFile) -> dict[str, dict[str, int]]:
    """Tensor type name -> tensor count, parameters and bytes, largest first."""
    hist: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "params": 0, "bytes": 0})
    for t in g.tensors.values():
        row = hist[t.qtype.name]
        row["tensors"] += 1
        row["params"] += t.n_elements
        row["bytes"] += t.nbytes
    return dict(sorted(hist.items(), key=lambda kv: -kv[1]["bytes"]))


def repacked_bytes(g, span=None) -> int:
    """Bytes the kernels copy out of the mapping at load (their repacks are views where they
    can be); each weight is prepared as a model load would, which touches no weight pages.
    The layers of a ggml span load nothing on the host."""
    from edgeinfer import kernels  # imports Numba: only when info runs
    from edgeinfer.ggml.layers import MATRICES

    skip = set()
    if span is not None:
        skip = {f"blk.{i}.{s}" for i in range(span.first, span.stop) for s in MATRICES.values()}
    return sum(
        kernels.QuantWeight.from_raw(
            g.tensor_data(name), t.qtype, (t.n_elements // t.shape[-1], t.shape[-1])
        ).extra_nbytes
        for name, t in g.tensors.items()
        if name not in skip
    )


def device_plan(g, cfg, span, mem: dict) -> dict:
    """A ggml span's memory on its device (weights, KV cache, a step's buffers) against the
    device's free memory as ggml reports it; a host device shares the RAM the host plan uses."""
    from edgeinfer.config import PREFILL_CHUNK
    from edgeinfer.ggml.backends import open_backend
    from edgeinfer.ggml.placement import endpoint, is_rpc
    from edgeinfer.ggml.rpc import probe
    from edgeinfer.ggml.span import SpanExecutor

    if is_rpc(span.backend):  # asked from here: ggml's RPC client would abort on a bad server
        server = probe(endpoint(span.backend))
        free, host = server.free, False
        device = f"ggml RPC server {server.endpoint} (protocol {server.version})"
    else:
        backend = open_backend(span.backend)
        try:
            free, _ = backend.memory()
            host, device = backend.is_host, backend.describe()
        finally:
            backend.close()
    blocks, _ = memory_plan.kv_pools(cfg, mem["ctx"], mem["parallel"], mem["kv_dtype"])
    tokens = min(PREFILL_CHUNK, mem["ctx"])
    need = SpanExecutor.planned_bytes(
        g, cfg, span, blocks, mem["kv_dtype"], tokens, mem["parallel"], host
    )
    total = sum(need.values())
    shared = mem["total_bytes"] if host else 0  # the host plan draws on the same RAM
    return {
        "span": span.describe(),
        "device": device,
        "host_memory": host,
        "weights_bytes": need["weights"],
        "kv_bytes": need["KV cache"],
        "compute_bytes": need["compute"],
        "total_bytes": total,
        "free_bytes": free,
        "fits": total + shared <= free,
    }


def draft_plan(spec: str, target: GGUFFile, cfg: ModelConfig, mem: dict) -> dict:
    """The memory a draft model adds (--spec draft:MODEL): its weights, and a KV cache of its
    own that holds as many tokens as the target's (every layer every token) beside the target's
    plan; its vocabulary checked against the target's as a run would."""
    from edgeinfer.speculative.draft_model import check_same_vocab

    name = spec.removeprefix("draft:")
    path = resolve_model(name)
    with read_gguf(path) as g:
        check_same_vocab(g, target, name)
        dcfg = ModelConfig.from_gguf(g)
        ctx, kv_dtype = mem["ctx"], mem["kv_dtype"]
        memory_plan.check_kv_dims(kv_dtype, dcfg.head_dim, dcfg.v_head_dim)
        full, _ = memory_plan.kv_pools(cfg, ctx, mem["parallel"], kv_dtype)
        seqs = memory_plan.draft_sequences(full, ctx)
        weights, repacked = memory_plan.weights_bytes(g), repacked_bytes(g)
        kv = memory_plan.kv_bytes(dcfg, ctx, seqs, kv_dtype, window_capped=False)
        act = memory_plan.activation_bytes(dcfg, ctx, seqs)
        total = weights + repacked + kv + act
        return {
            "path": str(path),
            "name": dcfg.name,
            "sequences": seqs,
            "weights_bytes": weights,
            "repacked_bytes": repacked,
            "kv_bytes": kv,
            "activation_bytes": act,
            "total_bytes": total,
            "fits": mem["total_bytes"] + total <= mem["available_bytes"],
        }


def gather(
    path: Path,
    ctx: int | None,
    parallel: int,
    kv_dtype: str,
    offload: str | None = None,
    gpu_layers: int | None = None,
    rpc: str | None = None,
    spec: str | None = None,
) -> dict:
    """Everything `info` reports, as one JSON-able dict (the --json output)."""
    from edgeinfer.ggml.placement import check_offload, resolve, rpc_endpoints
    from edgeinfer.ggml.rpc import free_memory

    with read_gguf(path) as g:
        cfg = ModelConfig.from_gguf(g)
        if offload is not None:
            check_offload(offload)
        servers = rpc_endpoints(offload, rpc)
        free = free_memory(servers) if servers else {}
        span = resolve(offload, gpu_layers, cfg.n_layers, rpc, free)
        host = None if span is None else [
            i for i in range(cfg.n_layers) if not span.first <= i < span.stop
        ]  # fmt: skip
        plan = memory_plan.plan(
            cfg,
            g,
            ctx=ctx,
            parallel=parallel,
            kv_dtype=kv_dtype,
            repacked_bytes=repacked_bytes(g, span),
            host_layers=host,
        )
        tensor_bytes = memory_plan.weights_bytes(g)
        mem = plan.as_dict()
        devices = [] if span is None else [device_plan(g, cfg, p, mem) for p in span.pieces]
        draft = draft_plan(spec, g, cfg, mem) if spec and spec.startswith("draft:") else None
        return {
            "path": str(path),
            "file_size": g.file_size,
            "gguf_version": g.version,
            "architecture": cfg.arch,
            "name": cfg.name,
            "n_params": cfg.n_params,
            "bits_per_weight": round(tensor_bytes * 8 / cfg.n_params, 3) if cfg.n_params else 0,
            "tensor_types": type_histogram(g),
            "n_layers": cfg.n_layers,
            "n_embd": cfg.n_embd,
            "n_ff": cfg.n_ff,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "v_head_dim": cfg.v_head_dim,
            "context_length": cfg.ctx_len,
            "vocab_size": cfg.vocab_size,
            "sliding_window": cfg.sliding_window,
            "tied_output": cfg.tied_output,
            "tokenizer": {
                "model": g.get("tokenizer.ggml.model"),
                "pre": g.get("tokenizer.ggml.pre"),
            },
            "chat_template": g.get("tokenizer.chat_template") is not None,
            "memory": mem,
            "device": None if span is None else devices[0],
            "devices": devices,  # one per backend of the span
            "speculative": spec,
            "draft": draft,  # --spec draft:MODEL's memory, beside "memory"
        }


def render(info: dict) -> str:
    """The human-readable report; every line but the file path fits in 80 columns."""
    tok = info["tokenizer"]
    tok_kind = f"{tok['model']} (pre: {tok['pre']})" if tok["pre"] else str(tok["model"])
    lines = [
        f"{info['name']}",
        f"  file          {info['path']}",
        f"  architecture  {info['architecture']}   (GGUF v{info['gguf_version']})",
        f"  parameters    {human_count(info['n_params'])}   file {human_bytes(info['file_size'])}"
        f"   {info['bits_per_weight']:.2f} bits/weight",
        f"  layers        {info['n_layers']}   embedding {info['n_embd']}   FFN {info['n_ff']}",
        f"  attention     heads {info['n_heads']}   KV heads {info['n_kv_heads']}   "
        f"head dim {info['head_dim']}" + _v_dim(info),
        f"  context       {info['context_length']} tokens   vocab {info['vocab_size']}",
        f"  tokenizer     {tok_kind}   chat template: "
        + ("yes" if info["chat_template"] else "no"),
    ]
    mem = info["memory"]
    if mem["sliding_layers"]:
        lines.append(
            f"  sliding       window {mem['sliding_window']} tokens on "
            f"{mem['sliding_layers']} of {info['n_layers']} layers"
        )
    lines.append("tensor types")
    for name, row in info["tensor_types"].items():
        lines.append(
            f"  {name:<6} {row['tensors']:5d} tensors {human_count(row['params']):>10} params "
            f"{human_bytes(row['bytes']):>11}"
        )
    lines += render_plan(mem)
    for dev in info.get("devices") or []:
        lines += render_device(dev)
    if info.get("draft"):
        lines += render_draft(info["draft"], mem)
    elif info.get("speculative") == "ngram":
        lines.append("speculative decoding: prompt lookup (no memory beyond the plan above)")
    if mem["ctx"] > info["context_length"]:
        lines.append(f"  note: ctx {mem['ctx']} is beyond the trained {info['context_length']}")
    return "\n".join(lines)


def _v_dim(info: dict) -> str:
    return "" if info["v_head_dim"] == info["head_dim"] else f" (V {info['v_head_dim']})"


def render_plan(mem: dict) -> list[str]:
    repacked = mem["repacked_bytes"]
    limit = "model limit" if mem["max_ctx_limit"] == "model" else "memory limit"
    rows = [
        ("weights (memory-mapped)", human_bytes(mem["weights_bytes"]), ""),
        ("repacked weights", "not estimated" if repacked is None else human_bytes(repacked), ""),
        (
            "KV cache",
            human_bytes(mem["kv_bytes"]),
            f"{human_bytes(mem['kv_bytes_per_token'])}/token, {mem['block_tokens']}-token blocks",
        ),
    ]
    if mem["sliding_layers"]:
        rows.append(
            (
                "KV without window cap",
                human_bytes(mem["kv_bytes_every_token"]),
                f"{mem['sliding_layers']} sliding layers, window {mem['sliding_window']}",
            )
        )
    rows += [
        (
            "activations",
            human_bytes(mem["activation_bytes"]),
            f"{min(mem['prefill_chunk'], mem['ctx'])}-token prefill chunk + logits",
        ),
        ("total", human_bytes(mem["total_bytes"]), ""),
        ("RAM available now", human_bytes(mem["available_bytes"]), ""),
        ("fits", "yes" if mem["fits"] else "NO", ""),
        ("largest context", f"{mem['max_ctx']} tokens", f"per sequence, {limit}"),
    ]
    seqs = "sequence" if mem["parallel"] == 1 else "sequences"
    return _table(
        f"memory plan: ctx {mem['ctx']} x {mem['parallel']} {seqs}, KV cache {mem['kv_dtype']}",
        rows,
    )


def _table(title: str, rows: list[tuple[str, str, str]]) -> list[str]:
    # (label, value, note) rows under a title, values right-aligned in one column
    lines = [title]
    for label, value, note in rows:
        lines.append(f"  {label:<24}{value:>13}" + (f"   ({note})" if note else ""))
    return lines


def render_draft(draft: dict, mem: dict) -> list[str]:
    seqs = "sequence" if draft["sequences"] == 1 else "sequences"
    rows = [
        ("weights (memory-mapped)", human_bytes(draft["weights_bytes"]), ""),
        ("repacked weights", human_bytes(draft["repacked_bytes"]), ""),
        (
            "KV cache",
            human_bytes(draft["kv_bytes"]),
            f"ctx {mem['ctx']} x {draft['sequences']} {seqs}, every layer every token",
        ),
        ("activations", human_bytes(draft["activation_bytes"]), ""),
        ("total", human_bytes(draft["total_bytes"]), ""),
        ("fits with the target", "yes" if draft["fits"] else "NO", ""),
    ]
    return _table(f"draft model plan: {draft['name']} (speculative decoding)", rows)


def render_device(dev: dict) -> list[str]:
    where = "host RAM, shared with the plan above" if dev["host_memory"] else "device memory"
    rows = [
        ("weights", dev["weights_bytes"], "mapped from the file" if dev["host_memory"] else ""),
        ("KV cache", dev["kv_bytes"], ""),
        ("compute buffers", dev["compute_bytes"], "estimate: a full prefill chunk"),
        ("total", dev["total_bytes"], ""),
        ("free now", dev["free_bytes"], where),
    ]
    rows = [(label, human_bytes(value), note) for label, value, note in rows]
    rows.append(("fits", "yes" if dev["fits"] else "NO", ""))
    out = _table(f"device plan: {dev['span']}", rows)
    out.insert(1, f"  device                  {dev['device']}")
    return out


def info(
    model: Annotated[
        str, typer.Argument(help=f"a .gguf file or a short name ({', '.join(MODELS)})")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    ctx: Annotated[
        int | None,
        typer.Option(
            min=1, help="tokens per sequence (default: the model's context length, at most 4096)"
        ),
    ] = None,
    parallel: Annotated[int, typer.Option(min=1, help="concurrent sequences")] = 1,
    kv_dtype: Annotated[KVDtype, typer.Option(help="KV cache element type")] = KVDtype["f16"],
    offload: Offload = None,
    gpu_layers: GpuLayers = None,
    rpc: Rpc = None,
    spec: Spec = None,
) -> None:
    """Show a model's metadata, tensor types and memory plan (with --gpu-layers or --offload:
    host and device memory planned separately; with --spec draft:MODEL, the draft model's
    weights and KV cache too)."""
    if offload is not None and gpu_layers:
        raise EdgeInferError("give either --offload or --gpu-layers, not both")
    EngineConfig(speculative=spec)  # checks its form as a run would
    path = resolve_model(model)
    data = gather(path, ctx, parallel, kv_dtype.value, offload, gpu_layers, rpc, spec)
    typer.echo(json.dumps(data, indent=2) if as_json else render(data))
