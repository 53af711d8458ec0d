"""The parts of a transformer around its MoE blocks, device-resident on one device of a run.

``Blocks`` holds, for the layers one device runs, what llama.cpp computes besides the experts
(hparams.py): each layer's attention weights, norms and F16 KV cache, the dense FFN of a
leading dense layer, and on the first device the token embeddings, on the last the output norm
and head. deepseek2's latent attention (hparams.Mla) keeps one cache row a token, the latent and
the rotated key side by side, which attention reads as both keys and values; its per-head
``attn_k_b`` and ``attn_v_b`` are ``mul_mat_id`` calls with a head for an expert. Its methods
only enqueue kernels on the stream they are given, in the order a layer needs them; the runner
(runner.py) puts them into its splits. A dense projection is a ``mul_mat_id`` over one expert,
so every weight type the expert kernels decode works here too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._closing import Closing
from ..backends.base import BufferView, Device, DeviceBuffer, Stream, Usage
from ..errors import InvalidArgument
from ..kernels import MoeKernels, dense, layout, recurrent
from ..kernels import attention as attention_kernels
from ..kernels.launcher import DirectInputs
from ..model import ModelError, MoeModel, TensorInfo
from . import standin
from .hparams import Transformer
from .uploads import Uploads


@dataclass(frozen=True)
class Linear:
    """A dense projection y = W x (+ b): W [n_out, n_in] of the file's type, b float32 [n_out]."""

    info: TensorInfo
    weight: BufferView
    bias: BufferView | None = None

    @property
    def n_in(self) -> int:
        return self.info.ne[0]

    @property
    def n_out(self) -> int:
        return self.info.ne[1]

    def apply(
        self,
        kernels: MoeKernels,
        stream: Stream,
        x: BufferView,
        rows: int,
        y: BufferView,
        ids: BufferView,
        prepared: DirectInputs | None = None,
        silu_gate: BufferView | None = None,
    ) -> None:
        kernels.mul_mat_id(
            stream,
            self.weight,
            self.info.qtype,
            1,
            self.n_out,
            self.n_in,
            x,
            False,
            ids,
            rows,
            1,
            y,
            prepared=prepared,
            silu_gate=silu_gate,
        )
        if self.bias is not None:
            dense.add_rows(kernels, stream, y, self.bias, rows, self.n_out)

    def apply_heads(
        self, kernels: MoeKernels, stream: Stream, x: BufferView, rows: int, y: BufferView, heads: BufferView
    ) -> None:
        """y[t, h] = W[h] x[t, h] for a per-head tensor [n_in, n_out, n_head] (deepseek2's attn_k_b and
        attn_v_b): ``mul_mat_id`` with each head an expert, ``heads`` int32 [rows, n_head] = 0..n_head-1.
        A few rows take the matrix-vector kernels whatever the number of heads: each head's weight is
        read once a row either way, in one launch instead of the tile path's grouping, rounding and
        product."""
        n_head = self.info.ne[2]
        kernels.mul_mat_id(stream, self.weight, self.info.qtype, n_head, self.n_out, self.n_in, x, True, heads, rows,
                           n_head, y, gemv=kernels.uses_gemv(rows))  # fmt: skip


@dataclass(frozen=True)
class _Attention:
    norm: BufferView
    q: Linear  # with gated attention each head's query, then its output gate
    k: Linear
    v: Linear
    out: Linear
    q_norm: BufferView | None
    k_norm: BufferView | None
    sinks: BufferView | None
    ffn_norm: BufferView
    k_cache: BufferView
    v_cache: BufferView

    @property
    def cache_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes


@dataclass(frozen=True)
class _DeltaNet:
    """qwen3next's recurrent layer (hparams.DeltaNet) and its two states, kept between batches."""

    norm: BufferView
    qkv: Linear  # attn_qkv: the convolution's channels, q, k and v
    z: Linear  # attn_gate: the output norm's gate
    ba: Linear  # ssm_ba: per key head its value heads' beta logits, then their alphas
    conv: BufferView  # ssm_conv1d [conv_dim, kernel], float32
    dt: BufferView
    a: BufferView  # ssm_a: negative decay rates
    out_norm: BufferView  # ssm_norm [head_dim]
    out: Linear  # ssm_out
    ffn_norm: BufferView
    conv_state: BufferView  # [kernel - 1, conv_dim]
    state: BufferView  # [v_heads, head_dim, head_dim]

    @property
    def cache_bytes(self) -> int:
        return self.conv_state.nbytes + self.state.nbytes


@dataclass(frozen=True)
class _Latent:
    """deepseek2's attention weights (hparams.Mla); the cache holds keys and values in one row."""

    norm: BufferView
    q_a: Linear | None  # with q_a_norm and q (attn_q_b) where the file has a query latent
    q_a_norm: BufferView | None
    q: Linear  # attn_q or attn_q_b: [n_head, nope + rope] a token
    kv_a: Linear  # attn_kv_a_mqa: the latent, then the key's part to rotate
    kv_norm: BufferView
    k_b: Linear  # [nope, kv_lora_rank, n_head]
    v_b: Linear  # [kv_lora_rank, v_head_dim, n_head]
    out: Linear
    ffn_norm: BufferView
    k_cache: BufferView

    @property
    def v_cache(self) -> BufferView:
        return self.k_cache  # the value is the latent: the key row's first kv_lora_rank

    @property
    def cache_bytes(self) -> int:
        return self.k_cache.nbytes


@dataclass(frozen=True)
class _DenseFfn:
    gate: Linear
    up: Linear
    down: Linear


class Blocks(Closing):
    """Attention, norms, KV cache and dense FFNs of ``layers`` on ``device``; embeddings and head where asked."""

    def __init__(
        self,
        device: Device,
        model: MoeModel,
        spec: Transformer,
        kernels: MoeKernels,
        layers: Sequence[int],
        *,
        rows: int,
        n_ctx: int,
        first: bool,
        last: bool,
    ) -> None:
        self.device = device
        self.model = model
        self.spec = spec
        self.kernels = kernels
        self.rows = rows
        self.n_ctx = n_ctx
        self._uploads = Uploads(device, model)
        self._scratch: dict[str, DeviceBuffer] = {}
        try:
            self.attention: dict[int, _Attention | _Latent | _DeltaNet] = {i: self._layer(i) for i in layers}
            moe = {layer.index for layer in model.layers}
            self.dense_ffn = {index: self._dense_ffn(index) for index in layers if index not in moe}
            self.embeddings = self._embeddings() if first else None
            head = self._head() if last else None
            self.output_norm: BufferView | None = head[0] if head else None
            self.output: Linear | None = head[1] if head else None
            self._allocate_scratch()
        except BaseException:
            self.close()
            raise

    # -- weights ----------------------------------------------------------------------------
    def _tensor(self, name: str) -> TensorInfo:
        info = self.model.optional_tensor(name)
        if info is None:
            raise ModelError(f"{self.model.path}: no tensor {name!r}; a {self.spec.arch.arch} layer needs it")
        return info

    def _optional_floats(self, name: str) -> BufferView | None:
        info = self.model.optional_tensor(name)
        return None if info is None else self._uploads.floats(info)

    def _linear(self, name: str, n_in: int, n_out: int, heads: int = 0) -> Linear:
        """A projection [n_in, n_out], or with ``heads`` one per head [n_in, n_out, heads]."""
        info = self._tensor(f"{name}.weight")
        shape = (n_in, n_out, heads) if heads else (n_in, n_out)
        if tuple(info.ne[: len(shape)]) != shape or any(d != 1 for d in info.ne[len(shape) :]):
            raise ModelError(f"{self.model.path}: {info.name} has shape {info.ne}; expected {shape}")
        return Linear(info, self._uploads.raw(info), self._optional_floats(f"{name}.bias"))

    def _attention(self, index: int) -> _Attention:
        spec, blk = self.spec, f"blk.{index}"
        kv_bytes = self.n_ctx * spec.kv_width * 2
        return _Attention(
            norm=self._uploads.floats(self._tensor(f"{blk}.attn_norm.weight")),
            q=self._linear(f"{blk}.attn_q", spec.n_embd, spec.q_width * (2 if spec.gated_attention else 1)),
            k=self._linear(f"{blk}.attn_k", spec.n_embd, spec.kv_width),
            v=self._linear(f"{blk}.attn_v", spec.n_embd, spec.kv_width),
            out=self._linear(f"{blk}.attn_output", spec.q_width, spec.n_embd),
            q_norm=self._optional_floats(f"{blk}.attn_q_norm.weight"),
            k_norm=self._optional_floats(f"{blk}.attn_k_norm.weight"),
            sinks=self._optional_floats(f"{blk}.attn_sinks.weight"),
            ffn_norm=self._uploads.floats(self._tensor(f"{blk}.{spec.arch.ffn_norm}.weight")),
            k_cache=self._uploads.view(kv_bytes),
            v_cache=self._uploads.view(kv_bytes),
        )

    def _layer(self, index: int) -> _Attention | _Latent | _DeltaNet:
        if self.spec.mla is not None:
            return self._latent(index)
        if self.spec.is_recurrent(index):
            return self._delta_net(index)
        return self._attention(index)

    def _delta_net(self, index: int) -> _DeltaNet:
        spec, blk = self.spec, f"blk.{index}"
        dn = spec.delta_net
        assert dn is not None
        conv = self._tensor(f"{blk}.ssm_conv1d.weight")
        if conv.ne[:2] != (dn.conv_kernel, dn.conv_dim):
            raise ModelError(f"{self.model.path}: {conv.name} has shape {conv.ne}; expected ({dn.conv_kernel}, "
                             f"{dn.conv_dim})")  # fmt: skip
        conv_state = (dn.conv_kernel - 1) * dn.conv_dim * 4
        state = dn.v_heads * dn.head_dim * dn.head_dim * 4
        return _DeltaNet(
            norm=self._uploads.floats(self._tensor(f"{blk}.attn_norm.weight")),
            qkv=self._linear(f"{blk}.attn_qkv", spec.n_embd, dn.conv_dim),
            z=self._linear(f"{blk}.attn_gate", spec.n_embd, dn.value_dim),
            ba=self._linear(f"{blk}.ssm_ba", spec.n_embd, 2 * dn.v_heads),
            conv=self._uploads.floats(conv),
            dt=self._uploads.floats(self._tensor(f"{blk}.ssm_dt.bias")),
            a=self._uploads.floats(self._tensor(f"{blk}.ssm_a")),
            out_norm=self._uploads.floats(self._tensor(f"{blk}.ssm_norm.weight")),
            out=self._linear(f"{blk}.ssm_out", dn.value_dim, spec.n_embd),
            ffn_norm=self._uploads.floats(self._tensor(f"{blk}.{spec.arch.ffn_norm}.weight")),
            # zeros, though a batch at position 0 never reads them: every byte written before it is read
            conv_state=self._zeros(conv_state),
            state=self._zeros(state),
        )

    def _zeros(self, nbytes: int) -> BufferView:
        return self._uploads.filled(nbytes, Usage.COMPUTE, lambda: np.zeros(nbytes, np.uint8)).view(0, nbytes)

    def _latent(self, index: int) -> _Latent:
        spec, blk = self.spec, f"blk.{index}"
        mla = spec.mla
        assert mla is not None
        q_a = q_a_norm = None
        q_in = spec.n_embd
        if mla.q_lora_rank:
            q_a = self._linear(f"{blk}.attn_q_a", spec.n_embd, mla.q_lora_rank)
            q_a_norm = self._uploads.floats(self._tensor(f"{blk}.attn_q_a_norm.weight"))
            q_in = mla.q_lora_rank
        cache_bytes = self.n_ctx * mla.key_width * 2
        return _Latent(
            norm=self._uploads.floats(self._tensor(f"{blk}.attn_norm.weight")),
            q_a=q_a,
            q_a_norm=q_a_norm,
            q=self._linear(f"{blk}.attn_q_b" if mla.q_lora_rank else f"{blk}.attn_q", q_in, spec.n_head * mla.q_head),
            kv_a=self._linear(f"{blk}.attn_kv_a_mqa", spec.n_embd, mla.key_width),
            kv_norm=self._uploads.floats(self._tensor(f"{blk}.attn_kv_a_norm.weight")),
            k_b=self._linear(f"{blk}.attn_k_b", mla.nope, mla.kv_lora_rank, heads=spec.n_head),
            v_b=self._linear(f"{blk}.attn_v_b", mla.kv_lora_rank, mla.v_head_dim, heads=spec.n_head),
            out=self._linear(f"{blk}.attn_output", spec.out_width, spec.n_embd),
            ffn_norm=self._uploads.floats(self._tensor(f"{blk}.{spec.arch.ffn_norm}.weight")),
            k_cache=self._uploads.view(cache_bytes),
        )

    def _dense_ffn(self, index: int) -> _DenseFfn:
        blk, n_embd = f"blk.{index}", self.spec.n_embd
        n_ff = self._tensor(f"{blk}.ffn_gate.weight").ne[1]
        return _DenseFfn(
            gate=self._linear(f"{blk}.ffn_gate", n_embd, n_ff),
            up=self._linear(f"{blk}.ffn_up", n_embd, n_ff),
            down=self._linear(f"{blk}.ffn_down", n_ff, n_embd),
        )

    def _embeddings(self) -> Linear:
        """The token embeddings: rows looked up, and the head's weights where the file ties the two."""
        return self._linear("token_embd", self.spec.n_embd, self.spec.n_vocab)

    def _head(self) -> tuple[BufferView, Linear]:
        norm = self._uploads.floats(self._tensor("output_norm.weight"))
        if self.model.optional_tensor("output.weight") is not None:
            return norm, self._linear("output", self.spec.n_embd, self.spec.n_vocab)
        # Tied to the embeddings: one copy where this device holds the table already.
        return norm, self.embeddings if self.embeddings is not None else self._embeddings()

    def _allocate_scratch(self) -> None:
        spec, rows = self.spec, self.rows
        n_ff = max((f.gate.n_out for f in self.dense_ffn.values()), default=0)
        sizes = {
            "xn": spec.n_embd,
            "q": spec.q_width,
            "k": spec.kv_width,
            "v": spec.kv_width,
            "att": spec.q_width,
            "o": spec.n_embd,
            "ffn_gate": n_ff,
            "ffn_up": n_ff,
            "ffn_act": n_ff,
        }
        if spec.gated_attention:
            sizes.update(q_gate=2 * spec.q_width, gate=spec.q_width)
        if (dn := spec.delta_net) is not None:
            sizes.update(mixed=dn.conv_dim, conv=dn.conv_dim, z=dn.value_dim, ba=2 * dn.v_heads, dn_heads=dn.value_dim)
        if (mla := spec.mla) is not None:
            n_head = spec.n_head
            sizes.update(
                q_a=mla.q_lora_rank,
                q_proj=n_head * mla.q_head,  # attn_q's rows: a head's unrotated part, then its rotated one
                q_nope=n_head * mla.nope,
                q_abs=n_head * mla.kv_lora_rank,
                kv=mla.key_width,
                att_c=n_head * mla.kv_lora_rank,
                heads=spec.out_width,
            )
            self.head_ids = self._uploads.filled(
                rows * n_head * 4, Usage.COMPUTE, lambda: np.tile(np.arange(n_head, dtype=np.int32), rows)
            )
        for name, width in sizes.items():
            self._scratch[name] = self._uploads.alloc(max(rows * width * 4, 4))
        self.zero_ids = self._uploads.filled(rows * 4, Usage.COMPUTE, lambda: np.zeros(rows, np.int32))
        # The decode attention's partial sums for the whole context and the fused launches' counters,
        # taken now: a captured decode step reads up to n_ctx rows, more chunks than the step run
        # before its capture, and a capture may not allocate.
        tokens = min(rows, attention_kernels.DECODE_MAX_TOKENS)
        attention_kernels.reserve_decode(self.kernels, tokens, spec.n_head, spec.n_head_kv, spec.head_dim, self.n_ctx)
        dense.reserve_project_add_rms_norm(self.kernels, min(rows, layout.GEMV_MAX_PAIRS))

    def _view(self, name: str, rows: int, width: int) -> BufferView:
        if rows > self.rows:
            raise InvalidArgument(f"{rows} rows exceed the {self.rows} the blocks were sized for", call="Blocks")
        return self._scratch[name].view(0, rows * width * 4)

    def _ids(self, rows: int) -> BufferView:
        return self.zero_ids.view(0, rows * 4)

    # -- what a layer enqueues -----------------------------------------------------------------
    def embed(self, stream: Stream, token_ids: BufferView, count: int, hidden: BufferView) -> None:
        """hidden[:count] = the embeddings of ``count`` token ids (int32 on the device)."""
        if self.embeddings is None:
            raise InvalidArgument("token embeddings live on the first device of a run", call="Blocks.embed")
        table = self.embeddings
        dense.get_rows(
            self.kernels, stream, table.weight, table.info.qtype, table.n_in, table.n_out, token_ids, count, hidden
        )

    def attend(
        self,
        stream: Stream,
        layer: int,
        hidden: BufferView,
        count: int,
        positions: BufferView,
        kv_len: int,
        ffn_x: BufferView | None = None,
        normed: bool = False,
    ) -> None:
        """hidden += attention(norm(hidden)) for ``count`` tokens at ``positions``; their keys and values
        go into the layer's cache first (a recurrent layer: its delta net, its states carried from the
        batch before unless positions[0] is 0). ``kv_len``: the cache rows the attention may read. With
        ``ffn_x``, also ffn_x = the FFN's norm of the new hidden (``ffn_input``), in the residual
        add's launch. ``normed``: ``norm_rows(count)`` already holds the attention's norm of hidden
        (``combine_norm``, the layer before's last launch)."""
        spec, a, k = self.spec, self.attention[layer], self.kernels
        ids = self._ids(count)
        xn, q = self.norm_rows(count), self._view("q", count, spec.q_width)
        o = self._view("o", count, spec.n_embd)
        if not normed:
            dense.rms_norm(k, stream, hidden, a.norm, xn, count, spec.n_embd, spec.eps)
        if isinstance(a, _DeltaNet):
            att = self._delta_net_rows(stream, a, xn, count, positions)
        else:
            if isinstance(a, _Latent):
                self._latent_inputs(stream, a, xn, count, positions, q)
            else:
                self._attention_inputs(stream, a, xn, count, positions, q)
            att = self._attend_cache(stream, a, layer, q, count, positions, kv_len)
        out = a.out
        if ffn_x is not None and out.bias is None and k.uses_gemv(count) and k.decode_epilogues:
            # A few rows: the projection, the residual add and the FFN's norm in one launch.
            dense.project_add_rms_norm(
                k, stream, out.weight, out.info.qtype, out.n_in, att, count, o, hidden, a.ffn_norm, ffn_x,
                spec.n_embd, spec.eps,
            )  # fmt: skip
            return
        out.apply(k, stream, att, count, o, ids)
        if ffn_x is None:
            standin.add_inplace(k, stream, hidden, o, count * spec.n_embd)
        else:
            dense.add_rms_norm(k, stream, hidden, o, a.ffn_norm, ffn_x, count, spec.n_embd, spec.eps)

    def _attention_inputs(
        self, stream: Stream, a: _Attention, xn: BufferView, count: int, positions: BufferView, q: BufferView
    ) -> None:
        """q = the heads' queries, normed and rotated; the tokens' keys and values into the cache."""
        spec, k = self.spec, self.kernels
        kk, v = self._view("k", count, spec.kv_width), self._view("v", count, spec.kv_width)
        q_out = self._view("q_gate", count, 2 * spec.q_width) if spec.gated_attention else q
        self._project((a.q, a.k, a.v), stream, xn, count, (q_out, kk, v), self._ids(count))
        if spec.gated_attention:  # each head's 2 * head_dim: its query, then its output gate
            gate, rows = self._view("gate", count, spec.q_width), count * spec.n_head
            dense.copy_columns(k, stream, q_out, 2 * spec.head_dim, 0, spec.head_dim, q, rows)
            dense.copy_columns(k, stream, q_out, 2 * spec.head_dim, spec.head_dim, spec.head_dim, gate, rows)
        inputs = dense.AttentionInputs(q, kk, v, a.q_norm, a.k_norm, a.k_cache, a.v_cache, positions)
        dense.qkv_rope_store(k, stream, inputs, count, spec.n_head, spec.n_head_kv, spec.head_dim, spec.rope, spec.eps)

    def _attend_cache(
        self,
        stream: Stream,
        a: _Attention | _Latent,
        layer: int,
        q: BufferView,
        count: int,
        positions: BufferView,
        kv_len: int,
    ) -> BufferView:
        """Attention of the queries q over the layer's cache; what the output projection reads."""
        spec, k = self.spec, self.kernels
        att = self._view("att", count, spec.q_width)
        attention_kernels.attention(
            k,
            stream,
            q,
            a.k_cache,
            a.v_cache,
            att,
            positions,
            n_tokens=count,
            kv_len=kv_len,
            n_head=spec.n_head,
            n_head_kv=spec.n_head_kv,
            head_dim=spec.head_dim,
            scale=spec.scale,
            window=spec.window(layer),
            sinks=a.sinks if isinstance(a, _Attention) else None,
            fused=k.decode_epilogues,
        )
        if isinstance(a, _Latent):
            return self._latent_heads(stream, a, att, count)
        if spec.gated_attention:
            recurrent.mul_sigmoid(k, stream, att, self._view("gate", count, spec.q_width), count * spec.q_width)
        return att

    def _delta_net_rows(
        self, stream: Stream, a: _DeltaNet, xn: BufferView, count: int, positions: BufferView
    ) -> BufferView:
        """qwen3next's recurrent layer over the batch's normed rows, its states carried: what ssm_out reads."""
        spec, k = self.spec, self.kernels
        dn = spec.delta_net
        assert dn is not None
        mixed, conv = self._view("mixed", count, dn.conv_dim), self._view("conv", count, dn.conv_dim)
        z, ba = self._view("z", count, dn.value_dim), self._view("ba", count, 2 * dn.v_heads)
        heads = self._view("dn_heads", count, dn.value_dim)
        self._project((a.qkv, a.z, a.ba), stream, xn, count, (mixed, z, ba), self._ids(count))
        recurrent.conv_silu(k, stream, mixed, a.conv_state, a.conv, positions, conv, count, dn.conv_dim, dn.conv_kernel)
        rows = recurrent.DeltaNetInputs(conv, ba, z, a.dt, a.a, a.out_norm, positions)
        recurrent.delta_net(k, stream, rows, a.state, heads, count, dn.k_heads, dn.v_heads, dn.head_dim, spec.eps)
        return heads

    def _latent_inputs(
        self, stream: Stream, a: _Latent, xn: BufferView, count: int, positions: BufferView, q_out: BufferView
    ) -> None:
        """deepseek2: q_out = each head's query absorbed into the latent, with its rotated part; the
        token's shared key row (the normed latent, the rotated key part) into the cache."""
        spec, k = self.spec, self.kernels
        mla = spec.mla
        assert mla is not None
        ids, n_head = self._ids(count), spec.n_head
        q, kv = self._view("q_proj", count, n_head * mla.q_head), self._view("kv", count, mla.key_width)
        if a.q_a is not None:  # the query through its latent; the latent and kv_a read the same rows
            q_a = self._view("q_a", count, mla.q_lora_rank)
            self._project((a.q_a, a.kv_a), stream, xn, count, (q_a, kv), ids)
            dense.rms_norm(k, stream, q_a, a.q_a_norm, q_a, count, mla.q_lora_rank, spec.eps)
            a.q.apply(k, stream, q_a, count, q, ids)
        else:
            self._project((a.q, a.kv_a), stream, xn, count, (q, kv), ids)
        q_nope = self._view("q_nope", count, n_head * mla.nope)
        q_abs = self._view("q_abs", count, n_head * mla.kv_lora_rank)
        dense.copy_columns(k, stream, q, mla.q_head, 0, mla.nope, q_nope, count * n_head)
        a.k_b.apply_heads(k, stream, q_nope, count, q_abs, self._heads(count))
        rows = dense.LatentInputs(q, q_abs, kv, a.kv_norm, positions)
        dense.mla_rope_store(k, stream, rows, q_out, a.k_cache, count, n_head, mla.kv_lora_rank, mla.nope, spec.rope,
                             spec.eps)  # fmt: skip

    def _latent_heads(self, stream: Stream, a: _Latent, att: BufferView, count: int) -> BufferView:
        """deepseek2: each head's attention output (over the cache rows, the latent's part of it) through
        attn_v_b: the heads' values side by side, what attn_output reads."""
        spec, k = self.spec, self.kernels
        mla = spec.mla
        assert mla is not None
        n_head, rank = spec.n_head, mla.kv_lora_rank
        att_c, heads = self._view("att_c", count, n_head * rank), self._view("heads", count, spec.out_width)
        dense.copy_columns(k, stream, att, mla.key_width, 0, rank, att_c, count * n_head)
        a.v_b.apply_heads(k, stream, att_c, count, heads, self._heads(count))
        return heads

    def _heads(self, rows: int) -> BufferView:
        return self.head_ids.view(0, rows * self.spec.n_head * 4)

    def _project(
        self,
        linears: Sequence[Linear],
        stream: Stream,
        x: BufferView,
        count: int,
        outputs: Sequence[BufferView],
        ids: BufferView,
    ) -> None:
        """outputs[i] = linears[i](x) for projections that read the same rows: where the matrix-vector
        kernels take the rows, each run of same-typed projections without biases in one launch
        (``mul_mat_vec_parts``); else one call each, sharing the rounded and grouped input where
        they all take a direct kernel of one tile height."""
        k = self.kernels
        if not k.uses_gemv(count) or any(lin.bias is not None for lin in linears):
            shared = self._shared_input(stream, linears, x, count, ids)
            for lin, y in zip(linears, outputs, strict=True):
                lin.apply(k, stream, x, count, y, ids, shared)
            return
        for qtype, run in itertools.groupby(zip(linears, outputs, strict=True), key=lambda pair: pair[0].info.qtype):
            parts = [(lin.weight, lin.n_out, y) for lin, y in run]
            k.mul_mat_vec_parts(stream, qtype, linears[0].n_in, x, count, parts)

    def _shared_input(
        self, stream: Stream, linears: Sequence[Linear], x: BufferView, count: int, ids: BufferView
    ) -> DirectInputs | None:
        """x rounded and its rows grouped once for projections that all read it through direct kernels
        of one tile height (``MoeKernels.prepare_direct``); None where any of them takes another kernel
        (the matrix-vector ones for a few rows, a type without direct kernels), each then preparing
        its own."""
        tiles = {self.kernels.direct_tile(lin.info.qtype, count, 1, lin.n_in) for lin in linears}
        if len(tiles) != 1 or (tile := tiles.pop()) is None:
            return None
        return self.kernels.prepare_direct(stream, x, ids, count, 1, 1, linears[0].n_in, tile)

    def ffn_input(self, stream: Stream, layer: int, hidden: BufferView, count: int, x: BufferView) -> None:
        """x = the layer's norm before its FFN, of hidden."""
        norm = self.attention[layer].ffn_norm
        dense.rms_norm(self.kernels, stream, hidden, norm, x, count, self.spec.n_embd, self.spec.eps)

    def run_dense_ffn(self, stream: Stream, layer: int, hidden: BufferView, count: int) -> None:
        """hidden += the dense FFN of a leading dense layer, of its norm of hidden."""
        ffn, n_embd, k = self.dense_ffn[layer], self.spec.n_embd, self.kernels
        ids, n_ff = self._ids(count), ffn.gate.n_out
        xn, o = self._view("xn", count, n_embd), self._view("o", count, n_embd)
        gate, up = self._view("ffn_gate", count, n_ff), self._view("ffn_up", count, n_ff)
        act = self._view("ffn_act", count, n_ff)
        self.ffn_input(stream, layer, hidden, count, xn)
        shared = self._shared_input(stream, (ffn.gate, ffn.up), xn, count, ids)
        ffn.gate.apply(k, stream, xn, count, gate, ids, shared)
        if ffn.up.bias is None and k.uses_gemv(count):
            ffn.up.apply(k, stream, xn, count, act, ids, silu_gate=gate)  # SwiGLU in the same launch
        else:
            ffn.up.apply(k, stream, xn, count, up, ids, shared)
            k.swiglu(stream, gate, up, act, count * n_ff)
        ffn.down.apply(k, stream, act, count, o, ids)
        standin.add_inplace(k, stream, hidden, o, count * n_embd)

    def head(self, stream: Stream, hidden: BufferView, count: int, logits: BufferView, normed: bool = False) -> None:
        """logits[:count] = output(norm(hidden[:count])), float32 [count, n_vocab]. ``normed``:
        ``norm_rows(count)`` already holds the output norm of hidden (``combine_norm``)."""
        if self.output is None or self.output_norm is None:
            raise InvalidArgument("the output head lives on the last device of a run", call="Blocks.head")
        xn = self.norm_rows(count)
        if not normed:
            dense.rms_norm(self.kernels, stream, hidden, self.output_norm, xn, count, self.spec.n_embd, self.spec.eps)
        self.output.apply(self.kernels, stream, xn, count, logits, self._ids(count))

    def norm_rows(self, count: int) -> BufferView:
        """Where the attention and the head read the norm of ``count`` hidden rows."""
        return self._view("xn", count, self.spec.n_embd)

    def norm_after(self, layer: int) -> BufferView | None:
        """The weights of the norm that reads the hidden rows after ``layer`` on this device: the next
        layer's attention norm, the output norm after the last layer; None where the rows go on to
        another device."""
        if layer + 1 in self.attention:
            return self.attention[layer + 1].norm
        if layer + 1 == self.spec.n_layer and self.output_norm is not None:
            return self.output_norm
        return None

    @property
    def device_bytes(self) -> int:
        return self._uploads.device_bytes

    @property
    def weight_bytes(self) -> int:
        return self._uploads.weight_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """The layers' caches: keys and values, or a recurrent layer's two states."""
        return sum(a.cache_bytes for a in self.attention.values())

    def close(self) -> None:
        self._scratch.clear()
        self._uploads.close()
