"""A Llama-family decoder (Llama, SmolLM2, Qwen2) in plain torch, reading and writing a paged KV pool.

Tokens of one step are flattened into one row dimension T: decode tokens first (one per sequence), then the prefill
chunks one after another. Linear layers run on all T rows at once; attention runs once per group of decode rows of
similar length (batched over their block tables) and once per prefill chunk.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from server.engine import linear as packed_linear
from server.engine.parallel.plan import ShardPlan, local_shape, vocab_slice

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelShape:
    """The numbers of a Llama-family config.json that the forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"model_type {model_type!r} is not supported (llama, qwen2, mistral)")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope_type not in ("default", None) else None,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or config.get("attention_bias", False),
        )


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prompt chunk: rows [start, start+length) of the step; `context_len` tokens already cached."""

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks needed for context_len + length] int64
    mask: torch.Tensor | None  # [length, num_blocks*block_size] bool; None: context_len == 0, or the kernel


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, start+count) attended together: block tables padded to the group's longest sequence.

    With the compiled kernel (`lengths` set) one group holds every decode row and the kernel reads each row's
    `lengths[i]` keys from the pool, never the padding. Without it the blocks are gathered, `mask` hides the
    padding (None when no row has any), and rows are grouped by length so little is padded."""

    start: int
    count: int
    block_tables: torch.Tensor  # [count, max_blocks] int64
    mask: torch.Tensor | None  # [count, 1, 1, max_blocks*block_size] bool
    lengths: torch.Tensor | None = None  # [count] int64: keys of each row (kernel path only)


@dataclass(slots=True)
class StepBatch:
    """Everything the forward needs for one step, built once per step as tensors.

    Invariant: rows [0, num_decode) are decode tokens, the prefill chunks follow in order; `slot_blocks` and
    `slot_offsets` name where row i's K/V is written; `logits_rows` are the rows whose next-token logits are wanted.
    """

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_blocks: torch.Tensor  # [T] int64
    slot_offsets: torch.Tensor  # [T] int64
    num_decode: int
    decode_groups: list[DecodeGroup]  # cover rows [0, num_decode) in order
    prefills: list[PrefillChunk]
    logits_rows: torch.Tensor  # [S] int64


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2*Hkv) * D, hidden]: q, k, v stacked
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate then up
    down: torch.Tensor


def _rope_inv_freq(shape: ModelShape) -> torch.Tensor:
    """Inverse frequencies (fp32), with llama3 / linear scaling applied when the config asks for it."""
    dim = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = shape.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"rope scaling {kind!r} is not supported (linear, llama3)")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class LlamaModel:
    """Weights plus the forward; the KV pool is owned by the caller and passed to `forward`.

    Batch invariance (`batch_invariant`): a token's logits are one computation, whatever else is in the step,
    however its prompt was chunked or cached, and whether it is decoded or recomputed after a resume. Every op
    but attention already is one here: the linear layers sum over K in one order at every row count (the compiled
    bf16 kernel by construction; oneDNN's packed fp32 GEMM as tests/engine/test_batch_invariant.py checks on the
    CPU it runs on), RMSNorm, RoPE and SiLU are per row, the sampler draws a seeded row from
    its own generator. Attention is not by default: a decode row goes through the decode kernel (an online
    softmax a 16-key block at a time, fp32 P), a prompt row through the bf16 prefill kernel (128-key steps, P
    rounded to bf16) or SDPA (fp32), so a continuation (migration, disaggregated decode, preemption's recompute)
    or a cached prompt whose last chunk is one token takes another path than the original. With the mode on,
    every row takes one path: bf16 with the prefill kernel, each decode row is a one-row chunk of it (the
    runner makes every row a prefill chunk); otherwise each prompt row is a decode row of the decode kernel with
    its own key count (model_runner `_prepare_rows`). Both kernels attend to a row's keys in fixed steps from key
    0, so the row's result does not depend on the chunk it came in. The cost is measured in docs/llm.md.
    """

    def __init__(
        self,
        shape: ModelShape,
        weights: Mapping[str, Any],
        dtype: torch.dtype,
        device: str,
        pack_weights: bool = True,
        decode_kernel: ModuleType | None = None,
        fused_ops: ModuleType | None = None,
        prefill_kernel: ModuleType | None = None,
        linear_kernel: ModuleType | None = None,
        batch_invariant: bool = False,
        shard: ShardPlan | None = None,
    ):
        """`decode_kernel`: the compiled kernels (server/engine/kernels) whose paged attention decodes from a CPU
        pool; None: gather. `fused_ops`: the same module, whose fused RMSNorm, RoPE + KV write and SiLU*up run
        a CPU forward's elementwise work; None: torch ops. `prefill_kernel`: the same module, whose bf16 prefill
        attention reads a chunk's keys from the pool (bf16 on a CPU with AVX512-BF16 or AMX, head_dim 64 or 128
        only; the model drops it otherwise); None: SDPA. `linear_kernel`: the same module, whose bf16 linear
        layers (AVX512-BF16) take the weights it can (linear.py); None: oneDNN or F.linear. `batch_invariant`:
        see the class docstring (needs `decode_kernel`; without it the model warns and stays as it is).
        `shard`: this rank's part of a sharded model (server/engine/parallel/plan.py): its slice of every weight,
        its layers, and `local` its shape (`join_group` before the first forward when it splits tensors). None:
        the whole model. `weights`: tensors, or slice handles (loader.open_weights) that read only a rank's part."""
        self.shape = shape  # the whole model's
        self.shard = shard
        self.local = shape if shard is None else local_shape(shape, shard)  # this rank's part
        self._tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.dtype = dtype
        self.device = torch.device(device)
        # linear weights reordered once for the CPU GEMM kernel (see linear.py); the embedding stays plain
        self.packed = pack_weights and packed_linear.can_pack(self.device, dtype)
        self.linear_kernel = linear_kernel if self.packed else None
        self.decode_kernel = decode_kernel if self.device.type == "cpu" else None
        self.fused = fused_ops if self.device.type == "cpu" else None
        self.prefill_kernel = (
            prefill_kernel if _bf16_prefill(prefill_kernel, self.device, dtype, shape) else None
        )
        self.batch_invariant = batch_invariant and self.decode_kernel is not None
        self.min_rows = 2 if self.batch_invariant else 1  # linear.linear: never one row for oneDNN
        if batch_invariant and not self.batch_invariant:
            log.warning(
                "batch_invariant needs the compiled CPU kernels (server/engine/kernels) and paged_kernel: "
                "this engine's tokens may depend on its batch"
            )

        def get(name: str, rows: range | None = None, cols: range | None = None) -> torch.Tensor:
            """The weight, or its `rows` / `cols` (a rank's slice), on the device in the model's dtype."""
            if name not in weights:
                raise KeyError(f"weight {name!r} missing from the checkpoint")
            weight = weights[name]  # a tensor, or a slice handle that reads what it is indexed with
            if rows is not None:
                weight = weight[rows.start : rows.stop]
            elif cols is not None:
                weight = weight[:, cols.start : cols.stop]
            elif not isinstance(weight, torch.Tensor):
                weight = weight[:]
            return weight.to(device=self.device, dtype=dtype)

        plan = shard or ShardPlan(1, 1, 0, shape.num_layers)
        tied = shape.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = get("model.embed_tokens.weight") if plan.first_stage else None
        self.norm = get("model.norm.weight") if plan.last_stage else None
        self.vocab_rows = vocab_slice(shape.vocab_size, plan.tp_size, plan.tp_rank)  # lm_head rows here
        self.lm_head = None
        if plan.last_stage:
            head = "model.embed_tokens.weight" if tied else "lm_head.weight"
            self.lm_head = self._pack(get(head, rows=self.vocab_rows))
        self.layers = [self._layer(get, i, plan) for i in plan.layers]
        positions = torch.arange(shape.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, _rope_inv_freq(shape))
        table = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = table.cos().to(device=self.device, dtype=dtype)
        self.rope_sin = table.sin().to(device=self.device, dtype=dtype)
        self.scale = shape.head_dim**-0.5
        self._buffers = [torch.empty(0, dtype=dtype, device=self.device) for _ in range(5)]

    def _layer(self, get, i: int, plan: ShardPlan) -> LayerWeights:
        """Layer `i`'s weights, this rank's slices: its heads' rows of q, k, v and columns of o_proj, its
        intermediate rows of gate and up and columns of down (all of them without tensor parallelism)."""
        p, local, d = f"model.layers.{i}.", self.local, self.shape.head_dim
        heads = range(plan.tp_rank * local.num_heads * d, (plan.tp_rank + 1) * local.num_heads * d)
        kv_heads = range(plan.tp_rank * local.num_kv_heads * d, (plan.tp_rank + 1) * local.num_kv_heads * d)
        inter = range(plan.tp_rank * local.intermediate_size, (plan.tp_rank + 1) * local.intermediate_size)
        qkv_rows = {"q": heads, "k": kv_heads, "v": kv_heads}
        bias = None
        if self.shape.qkv_bias:
            bias = torch.cat([get(p + f"self_attn.{n}_proj.bias", rows=qkv_rows[n]) for n in "qkv"])
        qkv = torch.cat([get(p + f"self_attn.{n}_proj.weight", rows=qkv_rows[n]) for n in "qkv"])
        gate_up = torch.cat([get(p + f"mlp.{n}_proj.weight", rows=inter) for n in ("gate", "up")])
        return LayerWeights(
            input_norm=get(p + "input_layernorm.weight"),
            qkv=self._pack(qkv),
            qkv_bias=bias,
            o_proj=self._pack(get(p + "self_attn.o_proj.weight", cols=heads)),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=self._pack(gate_up),
            down=self._pack(get(p + "mlp.down_proj.weight", cols=inter)),
        )

    def join_group(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Row-parallel outputs are summed by `all_reduce` (in place) over the tensor-parallel ranks from now on (a
        group's new generation after a restart brings a new one)."""
        if self.shard is not None and self.shard.tp_size > 1:
            self._tp_reduce = all_reduce

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output summed over the tensor-parallel group (itself without one)."""
        return partial if self._tp_reduce is None else self._tp_reduce(partial)

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        return packed_linear.pack(weight, self.packed, self.linear_kernel)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """HF's LlamaRMSNorm op for op (same rounding), with fewer temporaries; `x` is not modified."""
        h = x.float()  # `x` itself in fp32: not written below
        variance = h.pow(2).mean(-1, keepdim=True).add_(self.shape.rms_norm_eps)
        return (h * variance.rsqrt_()).to(x.dtype).mul_(weight)

    @torch.inference_mode()
    def forward(
        self, batch: StepBatch, kv_cache: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run one step of this rank's layers; write K/V of every row into `kv_cache`. Returns logits
        [S, vocab rows here] (fp32) for logits_rows on the last pipeline stage, else the residual stream [T, hidden]
        for the next stage. `hidden`: the previous stage's residual stream (this rank updates it in place); None on
        the first stage, which embeds `batch.token_ids`."""
        if hidden is None:
            hidden = self.embed[batch.token_ids]  # a fresh tensor: the residual stream is updated in place
        if self.fused is not None:
            return self._forward_fused(batch, kv_cache, hidden)
        s = self.local
        linear = packed_linear.linear
        cos = self.rope_cos[batch.positions].unsqueeze(1)
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = linear(x, layer.qkv, layer.qkv_bias, self.min_rows)
            qk = qkv[:, : q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            qk = (qk * cos).add_(_rotate_half(qk).mul_(sin))  # RoPE on q and k heads at once
            q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
            v = qkv[:, q_size + kv_size :].view(-1, s.num_kv_heads, s.head_dim)
            kv_cache[:, index, 0][batch.slot_blocks, batch.slot_offsets] = k
            kv_cache[:, index, 1][batch.slot_blocks, batch.slot_offsets] = v
            attn = self._attention(batch, q, k, v, kv_cache, index)
            hidden.add_(self._reduce(linear(attn, layer.o_proj, None, self.min_rows)))
            x = self._rms_norm(hidden, layer.post_norm)
            gate, up = linear(x, layer.gate_up, None, self.min_rows).chunk(2, dim=-1)
            hidden.add_(self._reduce(linear(F.silu(gate).mul_(up), layer.down, None, self.min_rows)))
        if self.lm_head is None:
            return hidden
        last = self._rms_norm(hidden[batch.logits_rows], self.norm)
        return linear(last, self.lm_head, None, self.min_rows).float()

    def _forward_fused(self, batch: StepBatch, kv_cache: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`forward` with each layer's elementwise work in the compiled fused ops: the same operations and
        roundings as the torch path above, one pass and one call each, into buffers reused by every layer."""
        s, ops, eps = self.local, self.fused, self.shape.rms_norm_eps
        linear = packed_linear.linear
        rows = batch.token_ids.shape[0]
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        x = torch.empty_like(hidden)  # each norm's output, the next linear's input
        q = torch.empty(rows, s.num_heads, s.head_dim, dtype=self.dtype, device=self.device)
        act = torch.empty(rows, s.intermediate_size, dtype=self.dtype, device=self.device)
        ops.rms_norm(hidden, self.layers[0].input_norm, eps, x)
        for index, layer in enumerate(self.layers):
            qkv = linear(x, layer.qkv, layer.qkv_bias, self.min_rows)
            ops.rope_cache(
                qkv, cos, sin, s.num_heads, s.num_kv_heads, kv_cache, index,
                batch.slot_blocks, batch.slot_offsets, q,
            )  # fmt: skip
            k = qkv[:, q_size : q_size + kv_size].view(rows, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size :].view(rows, s.num_kv_heads, s.head_dim)
            attn = self._attention(batch, q, k, v, kv_cache, index)
            o_proj = self._reduce(linear(attn, layer.o_proj, None, self.min_rows))
            ops.add_rms_norm(hidden, o_proj, layer.post_norm, eps, x)
            ops.silu_mul(linear(x, layer.gate_up, None, self.min_rows), act)
            down = self._reduce(linear(act, layer.down, None, self.min_rows))
            if index + 1 < len(self.layers):
                ops.add_rms_norm(hidden, down, self.layers[index + 1].input_norm, eps, x)
            else:
                hidden.add_(down)
        if self.lm_head is None:
            return hidden
        last = hidden[batch.logits_rows]
        ops.rms_norm(last, self.norm, eps, x[: last.shape[0]])
        return linear(x[: last.shape[0]], self.lm_head, None, self.min_rows).float()

    def _attention(self, batch: StepBatch, q, k, v, kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention output [T, H*D] for every row of `layer`: decode rows batched, each prefill chunk on its own."""
        s = self.local
        out = torch.empty(q.shape[0], s.num_heads * s.head_dim, dtype=q.dtype, device=q.device)
        # this layer's K and V rows of each block: [num_blocks, 2, block_size*Hkv*D]
        layer_cache = kv_cache.view(kv_cache.shape[0], s.num_layers, 2, -1)[:, layer]
        for group in batch.decode_groups:
            rows = slice(group.start, group.start + group.count)
            if group.lengths is not None:
                result = out[rows].view(group.count, s.num_heads, s.head_dim)
                self.decode_kernel.decode_attention(
                    q[rows], kv_cache, layer, group.block_tables, group.lengths, self.scale, result
                )
                continue
            keys, values = self._gather(layer_cache, group.block_tables)
            out[rows] = self._decode_attention(q[rows], keys, values, group.mask).reshape(group.count, -1)
        for chunk in batch.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            if self.prefill_kernel is not None:  # K/V of the chunk are in the pool already: read from there
                keys = chunk.context_len + chunk.length
                workspace = self._workspace(
                    4,
                    self.prefill_kernel.prefill_workspace_bytes(keys, s.num_kv_heads, s.head_dim),
                    torch.uint8,
                )
                self.prefill_kernel.prefill_attention(
                    q[rows], kv_cache, layer, chunk.block_table, chunk.context_len, self.scale,
                    out[rows].view(chunk.length, s.num_heads, s.head_dim), workspace,
                )  # fmt: skip
                continue
            query = q[rows].transpose(0, 1).unsqueeze(0)
            if chunk.context_len == 0:
                keys, values = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    query, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                keys, values = self._gather(layer_cache, chunk.block_table.unsqueeze(0))
                o = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=chunk.mask, scale=self.scale, enable_gqa=True
                )
            out[rows] = o[0].transpose(0, 1).reshape(chunk.length, -1)
        return out

    def _decode_attention(self, q, keys, values, mask) -> torch.Tensor:
        """One query per sequence: q [B, H, D], keys/values [B, Hkv, S, D] -> [B, H, 1, D].
        CPU SDPA is several times slower in bf16 than in fp32 at one query, so a bf16 engine upcasts the gathered
        K/V into reused fp32 workspaces (which also makes them contiguous) and attends in fp32."""
        if self.dtype != torch.float32 and self.device.type == "cpu":
            keys = self._workspace(2, keys.numel(), torch.float32).view(keys.shape).copy_(keys)
            values = self._workspace(3, values.numel(), torch.float32).view(values.shape).copy_(values)
            out = F.scaled_dot_product_attention(
                q.float().unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            return out.to(self.dtype)
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )

    def _gather(
        self, layer_cache: torch.Tensor, block_tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, nb] block ids -> keys and values, each a [B, Hkv, nb*block_size, D] view (token order) of a reused
        workspace: one index_select of whole block rows each, no other copy, no fresh allocation."""
        ids = block_tables.reshape(-1)
        row = layer_cache.shape[-1]
        keys = self._workspace(0, ids.numel() * row).view(-1, row)
        values = self._workspace(1, ids.numel() * row).view(-1, row)
        torch.index_select(layer_cache[:, 0], 0, ids, out=keys)
        torch.index_select(layer_cache[:, 1], 0, ids, out=values)
        shape = (block_tables.shape[0], -1, self.local.num_kv_heads, self.local.head_dim)
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)

    def _workspace(self, slot: int, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A flat buffer of at least `numel` elements, grown (doubling) on demand and kept: large per-layer
        temporaries would otherwise be fresh mmaps that page-fault on every step."""
        buffer = self._buffers[slot]
        if buffer.numel() < numel:
            buffer = torch.empty(
                max(numel, 2 * buffer.numel()), dtype=dtype or self.dtype, device=self.device
            )
            self._buffers[slot] = buffer
        return buffer[:numel]


def _bf16_prefill(
    kernels: ModuleType | None, device: torch.device, dtype: torch.dtype, shape: ModelShape
) -> bool:
    """Whether the compiled prefill attention applies: CPU, bf16, a build with AVX512-BF16 (AMX tiles where the
    CPU has them and the OS permits), and a head_dim it handles (64 or 128)."""
    return (
        kernels is not None
        and device.type == "cpu"
        and dtype == torch.bfloat16
        and shape.head_dim in (64, 128)
        and kernels.prefill_attention_available()
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
